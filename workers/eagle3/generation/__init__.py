"""The target's own answers to the prompts (`workers.generate`): the output file
(`generate_output`), an OpenAI-compatible server as the backend (`openai_backend`), and
prompts the target writes itself (`self_prompts`)."""
