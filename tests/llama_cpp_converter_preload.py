"""The converter module, imported in the fork server of tests/llama_cpp_converter.py (never in
the test process: its `gguf` is llama.cpp's own, put first on `sys.path`), with the libraries
its conversions import lazily."""

from __future__ import annotations

import importlib.util
import sys

from transformers import AutoConfig, AutoTokenizer  # noqa: F401  (each conversion's imports)

from tests.llama_cpp_converter import CONVERTER

CONVERTER_MODULE = None
if CONVERTER.exists():  # (the tests skip without it)
    sys.path.insert(0, str(CONVERTER.parent))  # as `python convert_hf_to_gguf.py` has it
    _spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", CONVERTER)
    CONVERTER_MODULE = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(CONVERTER_MODULE)
