"""The EAGLE-3 library's room: what it takes to hold a target the workers cannot load
through transformers as it ships (Kimi-K2.5's packed INT4 experts), the fp8 codec of
extracted hidden states (`workers.extract --store fp8`), and the hand-written held-out
questions `workers.evaluate` scores (handwritten.py, data/)."""
