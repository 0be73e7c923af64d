"""Causal language models as autoregressive token policies (the Qwen3-Omni Thinker or any transformers
`AutoModelForCausalLM`): the policy (policy.py), the Thinker's audio inputs (audio.py), the tiny builders (tiny.py:
"qwen3"; tiny_thinker.py: "qwen3_omni"; tiny_llava.py: "llava_judge", a tiny VLM judge) and the config-only real-size
folders (realsize.py: the Qwen3-Omni 30B-A3B Thinker; realsize_qwen3_vl.py: the Qwen3-VL-8B judge)."""
