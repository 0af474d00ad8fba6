"""The pure parts of a draft head's EAGLE-2 tree (EagleProposer._grow_trees): each node's children, the paths
a head pass feeds, and which nodes a step keeps.

A node is (token, parent, chance, depth): parent an index into the same sequence's node list (-1: the node
follows the sequence's last token), chance the estimate that the node is reached and accepted (the product of
its path's head probabilities; for a sampled request the rank's probability, see node_children), depth 1 for the
root's children.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specstream.sampling import STREAM_TREE_DRAW, probabilities_for, sample_from, uniform
from specstream.sequence import Sequence
from specstream.spec_decode.draft_head import DraftHead
from specstream.spec_decode.policy import ChainJudge, trusted
from specstream.spec_decode.proposer import Draft

Node = tuple[int, int, float, int]


def keep_best(
    nodes: dict[int, list[Node]],
    q_of: dict[tuple[int, int], torch.Tensor],
    ks: list[int],
    judge: ChainJudge,
    drafts: list[Draft],
    trust: Callable[[int, int], float] | None = None,
) -> None:
    """Keep nodes best first, across sequences, while they pay for their rows (at most k per sequence, a
    node after its parent and its elder siblings), as each sequence's tree draft; a sampled tree's with
    the q each node was drawn from. A sampled node's chance is its rank's (not its own token's): whether
    a draw is verified may depend on the draws before it, never on itself (EagleProposer._choose says why).
    trust(i, depth): what sequence i's chances at that depth are taken at (ChanceTrust; 1 without it); the
    drafts carry the chances as the head gave them."""
    ranked = sorted(
        (
            (c if trust is None else trusted(c, trust(i, d)), d, i, n)
            for i, ns in nodes.items()
            for n, (_, _, c, d) in enumerate(ns)
        ),
        key=lambda x: (-x[0], x[1]),
    )
    kept: dict[int, list[int]] = {i: [] for i in nodes}
    last_child: dict[tuple[int, int], int] = {}  # (sequence, node): its child ranked last so far, kept or not
    for chance, _, i, n in ranked:
        parent = nodes[i][n][1]
        elder = last_child.get((i, parent), -1)
        last_child[(i, parent)] = n
        if len(kept[i]) >= ks[i] or (parent >= 0 and parent not in kept[i]) or (elder >= 0 and elder not in kept[i]):
            continue
        if not judge.take(chance):
            break
        kept[i].append(n)
    for i, ns in kept.items():
        if not ns:
            continue
        index = {n: r for r, n in enumerate(ns)}
        sampled = (i, nodes[i][ns[0]][1]) in q_of
        drafts[i] = Draft(
            [nodes[i][n][0] for n in ns],
            torch.stack([q_of[(i, nodes[i][n][1])] for n in ns]) if sampled else None,
            "eagle",
            chances=[nodes[i][n][2] for n in ns],
            parents=[index.get(nodes[i][n][1], -1) for n in ns],
        )


def path_nodes(nodes: list[Node], ends: list[int]) -> list[int]:
    """The nodes on the paths to `ends`, by depth (parents first), `ends` last (they are the deepest)."""
    seen: set[int] = set()
    for n in ends:
        while n >= 0 and n not in seen:
            seen.add(n)
            n = nodes[n][1]
    inner = sorted((n for n in seen if n not in ends), key=lambda n: (nodes[n][3], n))
    return inner + list(ends)


def node_children(
    head: DraftHead, width: int, logits: torch.Tensor, owners: list[tuple[Sequence, int]], depth: int
) -> list[tuple[list[int], list[float], torch.Tensor | None]]:
    """Each row's children (row r: the head after node owners[r][1] of sequence owners[r][0], at `depth`):
    (tokens as target ids, their chances, q).
    - Greedy: the `width` likeliest tokens under the head and their probabilities (the chance that the
      target's argmax is that token, as far as the head knows); q None.
    - Sampled: `width` draws without replacement from the request's sampling distribution q of the head's
      logits, each with the uniform of its output position, node and draw (STREAM_TREE_DRAW), so that
      verify.py's recursive rejection sampling stays lossless; their chances are q's largest values in
      rank order (the i-th draw's, fixed before it is drawn)."""
    top = logits.float().softmax(-1).topk(min(width, logits.shape[-1]), dim=-1)
    out = list(zip(head.target_ids[top.indices].tolist(), top.values.tolist(), [None] * len(owners)))
    sampled = [r for r, (seq, _) in enumerate(owners) if not seq.params.greedy]
    if not sampled:
        return out
    q = probabilities_for(head.full_logits(logits[sampled]), [owners[r][0].params for r in sampled])
    ranked = q.topk(min(width, q.shape[-1]), dim=-1).values
    for row, r in enumerate(sampled):
        seq, node = owners[r]
        left, tokens = q[row].clone(), []
        for i in range(int((ranked[row] > 0).sum())):
            u = uniform(seq.seed, seq.num_output_tokens + depth - 1, STREAM_TREE_DRAW + (node + 1) * 64 + i)
            tokens.append(int(sample_from(left[None], torch.tensor([u], dtype=torch.float64))[0]))
            left[tokens[-1]] = 0.0
        out[r] = (tokens, ranked[row, : len(tokens)].tolist(), q[row])
    return out
