"""Every fact about vLLM that kvcal relies on, in one torch-free room below the checkpoint stage: what each release
serves and refuses per platform and backend (``caveats``), what its loaders read and write (``loaders``), the
platforms (``platforms``), the serve line (``serving``), and the release they were read in (``release``). Moving to a
new vLLM release is this folder's work (docs/architecture.md, "What a change touches"); background in
docs/vllm-notes.md."""
