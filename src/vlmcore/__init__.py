"""vlmcore: PyTorch-native training of Qwen3 / Qwen3-VL / Qwen3.5 vision-language models."""

__version__ = "0.1.0"
