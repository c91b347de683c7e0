"""The parts the families in `..families` share.

    _attention      softmax attention (fla's `Attention`, `transformers`' `HFAttention`), its `KVCache`
                    and a hybrid layer's `LayerCache` (its Mamba layer's and its attention's)
    _rotary         rotary position embeddings and token positions (packed sequences too)
    _norm           RMS norms: plain, zero-centred (`1 + w`), gated, grouped gated; fla's activations
    _mlp            `transformers`' MLPs, routers and mixtures of experts (on `recurrax.nn`'s MoE)
    _mixer          the call every layer here shares (`TokenLayer`: attention's and fla's recurrent
                    layers'), the recurrent layers' base (`FlaMixer`), their `RecurrentCache` and the
                    small helpers (`linear`, `heads`, `make_conv`)
    _qkv            the q/k/v-projection mixer base of GLA and RetNet
    _projected      the fused-projection mixer base of HGRN2 and LightNet
    _mamba2_mixer   the Mamba-2 SSD mixer on `recurrax.recurrent`
    _decoder        `DecoderBody`: embed_tokens, layers, norm (the `Body` a family module subclasses;
                    its calls are the shared decoder's, `recurrax.nn._decoder`)

The short convolutions are `recurrax.nn`'s (`nn/_conv.py`), the delta rule's layer
`nn/_gated_deltanet.py`, the routed experts `nn/_moe.py`.
"""
