"""The EAGLE-3 library the steps (`workers/<step>.py`) are built from, one room per
stage: `target` (loading the target model: dense, split over GPUs, packed INT4
experts), `generation` (the target's own answers), `extraction` (hidden states and
their files), `draft` (the draft model, its vocabulary mapping and its serving formats),
`training` (batches, held-out measure, checkpoints) and `evaluation` (speculative
decoding, its checks, the held-out and hand-written sets)."""
