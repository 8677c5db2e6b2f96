"""fw: declarative post-training for Qwen3 on PyTorch Lightning."""
