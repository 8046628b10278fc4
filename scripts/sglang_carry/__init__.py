"""sglang-carry: carry a short series of fixes on top of pinned SGLang and kvcached releases."""

__version__ = "0.1.0"
