"""The canonical form of a call: validation, the gate vocabulary, the public constructor.

(The code, `recurrax/_core/problem.py`, is one file on purpose: every check of the public
arguments — shapes, dtypes, gate signs, `cu_seqlens` — sits beside the folding it guards, so
the contract reads in one place.)

Everything a user can get wrong is caught here, at trace time, with a `ValueError` or
`TypeError` naming the argument, the expected shape in words and what came. What leaves
this module is a `Problem` that every algorithm takes as it is:

| field            | shape           | dtype                    | meaning                                  |
|------------------|-----------------|--------------------------|------------------------------------------|
| query            | [B, T, Hqk, K]  | input dtype              | Hqk = H, or shared: Hqk divides H ²      |
| key              | [B, T, Hqk, K]  | input dtype ¹            | grouped heads already expanded to H      |
| value            | [B, T, H, V]    | input dtype ¹            | grouped heads already expanded to H      |
| log_decay_head   | [B, T, H]       | state dtype, or None     | per-head g plus g_gamma (per row)        |
| log_decay_key    | [B, T, H, K]    | state dtype, or None     | per-channel g plus gk                    |
| log_decay_value  | [B, T, H, V]    | state dtype, or None     | gv                                       |
| initial_state    | [R, H, K, V]    | state dtype              | R = B, or S sequences when packed        |
| cu_seqlens       | [S + 1]         | int32, or None           | packed input: then B == 1                |

¹ The state dtype when grouped heads were expanded (Hkv < H): their gradients are then
summed over each group in float32 and rounded to the input dtype once.

² Query and key *shared* by groups of H / Hqk value heads (Mamba-2's layout: value head h
reads query/key head h // (H / Hqk)) stay unexpanded; `Problem.expanded()` repeats them to
H heads for the algorithms that do not take the shared form (`Support.shared_query_key`).

`g_gamma` may be `[H]`, `[1, H]`, or one row per batch row (`[B, H]`) or per packed
sequence (`[S, H]`); it is spread over the tokens of its row.

The key-side log decay of token t is `log_decay_head[t, h] + log_decay_key[t, h, :]`
(absent terms are zero and never materialised); the value-side one is
`log_decay_value[t, h, :]`. The state dtype is float32, or float64 for float64 inputs.
Gradients with respect to the user's arguments (head grouping, gate sums, dtype casts,
g_gamma's broadcast) come from JAX's autodiff of this normalisation.
"""

from ._core.problem import Gate, Problem, canonicalize, runtime_checks

__all__ = ["Gate", "Problem", "canonicalize", "runtime_checks"]
