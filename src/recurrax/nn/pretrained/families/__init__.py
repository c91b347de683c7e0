"""The model families `recurrax.nn.pretrained` reads, one module each.

    _gla, _retnet, _hgrn2,          fla's families: each module is the family's token mixer; fla's
    _linear_attn, _lightnet         config defaults and block wiring are their rows in `.._config`
    _mamba2                         `transformers`' Mamba-2 family (mamba2, nemotron_h, bamba,
                                    granitemoehybrid, falcon_h1, zamba2): config reading, blocks, body
    _zamba2                         Zamba2's shared blocks and hybrid layers (used by `_mamba2`)
    _qwen3_next                     Qwen3-Next and Qwen3.5 (dense and MoE text models)
    _olmo_hybrid                    OLMo-Hybrid
    _language_model                 recurrax.nn.LanguageModel (`recurrax_language_model`): its config,
                                    its own class as the model class (`MODEL`), checkpoints by module path

A `transformers` family is one module here (its `MODEL_TYPES`, `resolve`, `Body`,
`loaded_names`, `saved_names`; the contract is `.._config.FAMILY_MODULES`'s) and one entry of
`.._config.FAMILIES`. The parts families share (attention, MLPs and experts, norms, mixers and
their caches) are in `..layers`; the model, checkpoint I/O and generation around them in `..`.
"""
