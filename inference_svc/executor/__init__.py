"""The serving executor: the decoder a server runs, prepared once at load by an ordered list of named transforms.

`prepare` makes each load-time choice (CPU kernels, merged projections, quantization, each projection's linear
method, attention, sampler, compiled step) by a rule or a flag, never by a timing; `plan` records them with their
reasons in the `LoadPlan` that `tandem serve`'s start-up line, `GetModelInfo`, `GET /v1/models` and the
`tandem_load_choice` metric report.
"""
