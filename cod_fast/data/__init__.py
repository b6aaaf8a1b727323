"""What a rollout is and how rollouts become the loss's inputs: records, packing into micro-batches
(flat or as a prefix tree), and the metrics, diagnostics and transcripts read off them."""
