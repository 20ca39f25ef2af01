//! Tokenization as the served model does it (HF `tokenizer.json` + the chat template from
//! `tokenizer_config.json`). Used by the gateway (block keys of a prompt) and by the vLLM simulator.
