"""The EAGLE-3 draft: the model (`model`), its vocabulary mapping to the target's
(`vocab_mapping`), and the formats it is served in (`serving`: vLLM/SGLang's config;
`speculators_draft`: vllm-project/speculators')."""
