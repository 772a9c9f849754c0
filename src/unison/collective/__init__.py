"""Worker-to-worker collectives (shared memory on one host, torch.distributed across hosts)."""
