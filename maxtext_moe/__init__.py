"""maxtext-moe: DeepSeek-V3 dropless MoE training recipes on MaxText for NVIDIA GPUs."""

__version__ = "0.1.0"
