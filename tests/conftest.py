"""Test-session settings."""

import torch

# The tests use tiny networks: torch's intra-op threads only add overhead there, and
# on a loaded 2-core machine they oversubscribe the cores (10-50x slower).
torch.set_num_threads(1)
