"""The target model: what it is (`model.Target`), how a checkpoint is loaded
(`loading`), split over GPUs (`split`, planned by `load_plan`), and held with its
routed experts packed INT4 (`packed_experts`, run by the `w4a16_moe` kernel)."""
