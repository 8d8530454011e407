"""The chunked cross-entropy equals cross-entropy on the full logits, in value and gradients."""

import pytest
import torch
import torch.nn.functional as F

from lctrain.train.loss import IGNORE_INDEX, chunked_cross_entropy


@pytest.mark.parametrize("chunk_tokens", [1, 7, 64, 10_000])
def test_matches_full_logits(chunk_tokens: int) -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 40, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (2, 40), generator=gen)
    labels[0, 5] = labels[1, :3] = IGNORE_INDEX
    loss, count = chunked_cross_entropy(hidden, weight, labels, chunk_tokens=chunk_tokens)
    loss.backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    expected = F.cross_entropy((hidden @ weight.t()).reshape(-1, 50), labels.reshape(-1), reduction="sum")
    expected.backward()
    assert count.item() == 76
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=0)  # logits are computed in fp32
    torch.testing.assert_close(grads[0], hidden.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1], weight.grad, rtol=1e-5, atol=1e-6)


def test_errors() -> None:
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        chunked_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long), chunk_tokens=0)
    with pytest.raises(ValueError, match="disagree on the token dims"):
        chunked_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(5, dtype=torch.long))
