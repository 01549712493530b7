"""Runs in the reference venv (.venv-hf: torch + transformers), never in the product's: transformers' own
DeepseekV3 model writes a small checkpoint in DeepSeek-V3's published format and gives reference logits.

    write CONFIG OUT --tokens 1,2,3 --logits L.npy [--shards N]
        random DeepseekV3ForCausalLM from CONFIG (config.json); saved as DeepSeek-V3 ships: per-expert keys,
        FP8 e4m3 linear weights with 128x128 `weight_scale_inv` blocks, BF16 elsewhere, float32 router bias,
        one MTP layer (`model.layers.{num_hidden_layers}`: enorm, hnorm, eh_proj, shared_head) per
        `num_nextn_predict_layers`; shards + index. L.npy: the logits of the model with the stored weights.
    load DIR --tokens 1,2,3 --logits L.npy
        `DeepseekV3ForCausalLM.from_pretrained(DIR)` and its logits; fails if DIR lacks a weight the model has
        (transformers would start it at random) or holds one in another shape.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

BLOCK = 128
FP8_MAX = 448.0
QUANTIZED = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's block FP8: e4m3 values, one float32 scale_inv per 128x128 tile (edges partial)."""
    rows, cols = w.shape
    br, bc = -(-rows // BLOCK), -(-cols // BLOCK)
    padded = torch.zeros(br * BLOCK, bc * BLOCK)
    padded[:rows, :cols] = w
    tiles = padded.reshape(br, BLOCK, bc, BLOCK)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (tiles / scale[:, None, :, None]).reshape(br * BLOCK, bc * BLOCK)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale.float()


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    return q.float() * full[: q.shape[0], : q.shape[1]]


def hf_format(model: DeepseekV3ForCausalLM, config: DeepseekV3Config) -> dict[str, torch.Tensor]:
    """The model's weights under DeepSeek-V3's published names (per-expert), float32, plus the MTP layers."""
    out = {}
    for key, value in model.state_dict().items():
        if key.endswith("mlp.experts.gate_up_proj"):
            base = key.removesuffix("gate_up_proj")
            for e, w in enumerate(value):
                gate, up = w.chunk(2, dim=0)
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = gate, up
        elif key.endswith("mlp.experts.down_proj"):
            base = key.removesuffix("down_proj")
            for e, w in enumerate(value):
                out[f"{base}{e}.down_proj.weight"] = w
        else:
            out[key] = value
    g = torch.Generator().manual_seed(1)
    h = config.hidden_size
    moe = config.first_k_dense_replace  # a MoE layer's tensors, as the MTP layer's transformer block
    for k in range(config.num_nextn_predict_layers):
        mtp = f"model.layers.{config.num_hidden_layers + k}."
        for key in [key for key in out if key.startswith(f"model.layers.{moe}.")]:
            noise = torch.randn(out[key].shape, generator=g) * out[key].float().std().clamp(min=0.02)
            out[mtp + key.removeprefix(f"model.layers.{moe}.")] = out[key] + noise
        out |= {
            f"{mtp}enorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
            f"{mtp}hnorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
            f"{mtp}eh_proj.weight": 0.02 * torch.randn(h, 2 * h, generator=g),
            f"{mtp}shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
            f"{mtp}shared_head.head.weight": out["lm_head.weight"],
            f"{mtp}embed_tokens.weight": out["model.embed_tokens.weight"],
        }
    return out


def stored(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(what goes on disk, the float32 values it holds): FP8 + scales for the quantized linears, float32 for
    the router's bias, BF16 for the rest."""
    disk, values = {}, {}
    for key, w in tensors.items():
        if w.ndim == 2 and key.rsplit(".", 2)[-2] in QUANTIZED:
            q, s = quantize(w.float())
            disk[key], disk[key + "_scale_inv"] = q, s
            values[key] = dequantize(q, s)
        elif key.endswith("e_score_correction_bias"):
            disk[key] = values[key] = w.float()
        else:
            disk[key] = w.to(torch.bfloat16)
            values[key] = disk[key].float()
    return disk, values


def logits(model: DeepseekV3ForCausalLM, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def write(config_path: Path, out: Path, tokens: list[int], logits_path: Path, shards: int) -> None:
    torch.manual_seed(0)
    raw = json.loads(config_path.read_text())
    config = DeepseekV3Config(**raw)
    model = DeepseekV3ForCausalLM(config).float().eval()
    with torch.no_grad():  # transformers starts these at 0 and 1: random, so a misplaced one shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    disk, values = stored(hf_format(model, config))
    out.mkdir(parents=True)
    keys = list(disk)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: disk[k].contiguous() for k in keys[i::shards]}
        save_file(part, str(out / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, name)
    total = sum(t.numel() * t.element_size() for t in disk.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    quant = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    (out / "config.json").write_text(json.dumps(raw | {"quantization_config": quant}, indent=2))
    state = {}
    for key, value in model.state_dict().items():  # the model again, from the stored values
        if key.endswith("mlp.experts.gate_up_proj") or key.endswith("mlp.experts.down_proj"):
            base, which = key.rsplit(".", 1)
            parts = [
                torch.cat([values[f"{base}.{e}.gate_proj.weight"], values[f"{base}.{e}.up_proj.weight"]])
                if which == "gate_up_proj"
                else values[f"{base}.{e}.down_proj.weight"]
                for e in range(value.shape[0])
            ]
            state[key] = torch.stack(parts)
        else:
            state[key] = values[key]
    model.load_state_dict(state)
    np.save(logits_path, logits(model, tokens))


def load(folder: Path, tokens: list[int], logits_path: Path) -> None:
    model, info = DeepseekV3ForCausalLM.from_pretrained(str(folder), dtype=torch.float32, output_loading_info=True)
    wrong = {k: v for k, v in info.items() if k in ("missing_keys", "mismatched_keys", "error_msgs") and v}
    if wrong:
        raise SystemExit(f"{folder}: {wrong}")
    model.eval()
    np.save(logits_path, logits(model, tokens))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("command", choices=["write", "load"])
    p.add_argument("paths", nargs="+", type=Path)
    p.add_argument("--tokens", required=True)
    p.add_argument("--logits", required=True, type=Path)
    p.add_argument("--shards", type=int, default=3)
    a = p.parse_args()
    tokens = [int(t) for t in a.tokens.split(",")]
    if a.command == "write":
        write(a.paths[0], a.paths[1], tokens, a.logits, a.shards)
    else:
        load(a.paths[0], tokens, a.logits)


if __name__ == "__main__":
    main()
