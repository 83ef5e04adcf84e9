"""Scoring a draft against its target (`workers.evaluate`): speculative decoding
(`speculative`), its lossless checks (`eval_checks`), the held-out prompts (`heldout`)
and the hand-written questions (`handwritten`, data/)."""
