"""The rollout engine: an OpenAI-compatible chat-completions server over a local model.

It answers what the harness's OpenAI client asks (tool calls, return_token_ids, logprobs) and adds
`policy_version`, the version of the weights that generated a response, which the harness writes
into each turn. Backends: transformers (any machine; the library's own generate) and vLLM.
"""
