"""Test-session settings and shared references."""

import pytest
import torch

# The tests use tiny networks: torch's intra-op threads only add overhead there, and
# on a loaded 2-core machine they oversubscribe the cores (10-50x slower).
torch.set_num_threads(1)


def _per_example_gradients(layer, names, x, delta, steps=None, t=None):
    """(n, K, W) gradients of ``delta_k . layer(x)`` by autograd, one row and one
    output at a time, parameters in ``names`` order; row ``i`` at the layer's
    weights plus ``t_i steps`` when ``t`` is given."""
    out = []
    for i in range(x.shape[0]):
        params = {
            name: (p.detach() + (0.0 if t is None else t[i] * steps[name])).requires_grad_(True)
            for name, p in layer.named_parameters()
        }
        value = torch.func.functional_call(layer, params, (x[i : i + 1],))[0]
        rows = []
        for k in range(delta.shape[1]):
            grads = torch.autograd.grad(
                (delta[i, k] * value).sum(), [params[n] for n in names], retain_graph=True
            )
            rows.append(torch.cat([g.reshape(-1) for g in grads]))
        out.append(torch.stack(rows))
    return torch.stack(out)


@pytest.fixture
def per_example_gradients():
    """The autograd reference for per-example gradients of one layer (a function)."""
    return _per_example_gradients
