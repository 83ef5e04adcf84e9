"""Training the draft (`workers.train`): the extracted data as batches (`train_data`),
the target tensors it needs (`target_head`), the held-out measure (`train_heldout`),
and checkpoints (`checkpoints`)."""
