"""The EAGLE-3 library's target-loading room: what it takes to hold a target the
workers cannot load through transformers as it ships (Kimi-K2.5's packed INT4 experts)."""
