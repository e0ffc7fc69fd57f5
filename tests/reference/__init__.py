"""The tests' independent references, one module per family (tests/ is on sys.path: `from reference.model import ...`).

- model.py: the dynamic-shape reference model and cache (RefModel, RefLayer, RefPolicy, attention_probs, keep_indices,
  rope, rms_norm, run_stream): concatenate, score, sort, gather, with its own fp32 forward pass.
- blockwise.py: the block-wise policies' scores (KeyDiff, sink, key norm, TOVA, H2O, SnapKV, random) and
  REF_POLICIES, the name -> reference policy registry RefModel uses.
- caote.py: CAOTE / FastCAOTE's closed form (caote_reference) and RefCAOTE, re-ranking a block-wise base.
- kvec.py: K-VEC's one-shot compression per layer with the shared coverage counter (ref_layer, reference_for).
- sagekv.py: SAGE-KV's per-query-head selection and visible sets (RefSageLayer, reference_selection, ref_sizes).
- rocketkv.py: RocketKV's SnapKV++ compression and hybrid top-k decode, and Exact-TopK's per-query-head top-k
  (RefRocketLayer, snapkvpp_keep, rocket_select).
- engine_scorer.py: EngineScorer, RefLayer driven by an engine policy's own observe / score (the conformance suite).
- kvpress_keep.py: a standalone script run in the kvpress venv (.venv-kv) that records which positions NVIDIA
  kvpress's presses keep (test_kvpress.py); not imported.

Nothing here imports cache.py or policies.py, except engine_scorer.py, which deliberately calls an engine policy's
score on the reference's cache (so only the in-place mechanics are checked against the reference there).
"""
