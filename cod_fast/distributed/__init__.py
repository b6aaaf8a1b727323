"""Processes and devices: process groups and the device mesh, FSDP2, gathering and loading
sharded state, the trainer-to-worker channel, communication traces checked against NCCL's rules,
and host memory settings."""
