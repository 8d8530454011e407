"""The plain single-process computation of the preference losses from TRL's formulas, which the objective's tests
compare with: each ``[prompt, answer]`` a sequence of its own (the unshared layout) through the plain model. The pair
rows themselves are packed by ``testbed/pairs.py``."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from testbed.pairs import Pair


def sequence_logps(model: torch.nn.Module, pairs: Sequence[Pair]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion's summed log-prob and token count under the plain ``model``, every ``[prompt, answer]`` a
    sequence of its own (the unshared layout): fp64 ``[2K]`` (chosen, rejected, chosen, ...) and ``[2K]``."""
    logps, counts = [], []
    for prompt, chosen, rejected in pairs:
        for answer in (chosen, rejected):
            ids = torch.tensor([*prompt, *answer])[None]
            logits = model(input_ids=ids).logits[0, :-1].double()
            token_logps = F.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None]).squeeze(1)
            logps.append(token_logps[len(prompt) - 1 :].sum())
            counts.append(float(len(answer)))
    return torch.stack(logps), torch.tensor(counts, dtype=torch.float64)


def trl_loss(
    loss_type: str,
    policy: torch.Tensor,
    reference: torch.Tensor | None,
    counts: torch.Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
) -> torch.Tensor:
    """TRL's loss of one ``loss_type`` over a batch of pairs (``DPOTrainer``; ``simpo`` as ``CPOTrainer``, ``orpo``'s
    odds-ratio term as ``ORPOTrainer``, ``sft`` the token-mean cross-entropy of the chosen answers), written
    plainly: ``policy``, ``reference`` and ``counts`` ``[2K]`` as ``sequence_logps`` gives them."""
    pc, pr = policy[0::2], policy[1::2]
    nc, nr = counts[0::2], counts[1::2]
    if loss_type == "sft":
        return -pc.sum() / nc.sum()
    if loss_type in ("simpo", "orpo"):
        ac, ar = pc / nc, pr / nr
        if loss_type == "simpo":
            logits = ac - ar - simpo_gamma / beta
            losses = (
                -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
            )
        else:

            def log1mexp(x: torch.Tensor) -> torch.Tensor:
                return torch.log(-torch.expm1(x)) if x > -math.log(2) else torch.log1p(-torch.exp(x))

            log_odds = torch.stack([(a - b) - (log1mexp(a) - log1mexp(b)) for a, b in zip(ac, ar)])
            losses = -beta * F.logsigmoid(log_odds)
        return losses.mean()
    rc, rr = reference[0::2], reference[1::2]
    delta = (pc - rc) - (pr - rr)
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * delta)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif loss_type == "ipo":
        losses = ((pc - rc) / nc - (pr - rr) / nr - 1 / (2 * beta)) ** 2
    elif loss_type == "robust":
        clean = -(1 - label_smoothing) * F.logsigmoid(beta * delta)
        flipped = -label_smoothing * F.logsigmoid(-beta * delta)
        losses = (clean - flipped) / (1 - 2 * label_smoothing)
    else:
        raise ValueError(loss_type)
    return losses.mean()


def trl_metrics(policy: torch.Tensor, reference: torch.Tensor | None, counts: torch.Tensor, beta: float) -> dict:
    """TRL's pair metrics of a batch (rewards against the reference; without one, beta times the mean token
    log-prob, as its reference-free trainers)."""
    pc, pr = policy[0::2], policy[1::2]
    if reference is None:
        chosen, rejected = beta * pc / counts[0::2], beta * pr / counts[1::2]
    else:
        chosen, rejected = beta * (pc - reference[0::2]), beta * (pr - reference[1::2])
    return {
        "rewards/chosen": chosen.mean().item(),
        "rewards/rejected": rejected.mean().item(),
        "rewards/accuracies": (chosen > rejected).double().mean().item(),
        "rewards/margins": (chosen - rejected).mean().item(),
        "logps/chosen": pc.mean().item(),
        "logps/rejected": pr.mean().item(),
    }
