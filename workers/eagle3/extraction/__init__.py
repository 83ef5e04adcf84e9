"""Hidden states captured from the target (`workers.extract`): the forward passes
(`extractor`), the ranks and their parent (`ranks`, `extract_parent`), the files
written (`hidden_files`, `fp8_features`), and whether batching changes a sample
(`batch_invariance`)."""
