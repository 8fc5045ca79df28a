"""The transformers families users train, built small from their configurations (random weights,
nothing downloaded), as a user's own models (`tests.hf_families:NAME`): decoder LMs with
grouped-query attention and rotary embeddings (Qwen2, Mistral), an encoder-decoder (T5), an
encoder (DistilBERT), a CNN (ConvNeXt), mixtures of experts (Mixtral, Qwen2-MoE) and a state-space
model (Mamba). The language models take an attention mask, which crosses stage boundaries as a
non-contiguous view in some of them; the experts and Mamba split tensors into lists (`chunk`,
`topk`) whose elements cross boundaries."""

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _tf():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def _lm_batch(batch_size, seq_len, vocab, gen):
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _decoder(cls_name, cfg_name, batch_size, seq_len):
    tf = _tf()
    torch.manual_seed(0)
    cfg = getattr(tf, cfg_name)(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = getattr(tf, cls_name)(cfg)
    return model, _lm_batch(batch_size, seq_len, 128, torch.Generator().manual_seed(0))


def qwen2(batch_size=4, seq_len=16):
    return _decoder("Qwen2ForCausalLM", "Qwen2Config", batch_size, seq_len or 16)


def mistral(batch_size=4, seq_len=16):
    return _decoder("MistralForCausalLM", "MistralConfig", batch_size, seq_len or 16)


def mixtral(batch_size=4, seq_len=16, **config):
    """Mixture of experts: the router's top-k picks experts per token (its auxiliary loss, which
    balances them, is off unless `output_router_logits=True`)."""
    tf = _tf()
    torch.manual_seed(0)
    cfg = tf.MixtralConfig(**{"vocab_size": 128, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 4,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
                              "num_experts_per_tok": 2, "max_position_embeddings": 256,
                              "output_router_logits": False, **config})
    return tf.MixtralForCausalLM(cfg), _lm_batch(batch_size, seq_len or 16, 128, torch.Generator().manual_seed(0))


def qwen2_moe(batch_size=4, seq_len=16):
    tf = _tf()
    torch.manual_seed(0)
    cfg = tf.Qwen2MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                            shared_expert_intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
                            output_router_logits=False)
    return tf.Qwen2MoeForCausalLM(cfg), _lm_batch(batch_size, seq_len or 16, 128, torch.Generator().manual_seed(0))


def mamba(batch_size=4, seq_len=16):
    """A state-space model: no attention, a selective scan per block."""
    tf = _tf()
    torch.manual_seed(0)
    cfg = tf.MambaConfig(vocab_size=128, hidden_size=64, state_size=8, num_hidden_layers=4, expand=2, conv_kernel=4,
                         use_cache=False)
    batch = _lm_batch(batch_size, seq_len or 16, 128, torch.Generator().manual_seed(0))
    del batch["attention_mask"]
    return tf.MambaForCausalLM(cfg), batch


def t5(batch_size=4, seq_len=16):
    tf = _tf()
    torch.manual_seed(0)
    cfg = tf.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
                      decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0)
    batch = _lm_batch(batch_size, seq_len or 16, 128, torch.Generator().manual_seed(0))
    return tf.T5ForConditionalGeneration(cfg), batch


def distilbert(batch_size=4, seq_len=16):
    tf = _tf()
    torch.manual_seed(0)
    cfg = tf.DistilBertConfig(vocab_size=128, dim=64, hidden_dim=128, n_layers=4, n_heads=4,
                              max_position_embeddings=256)
    return tf.DistilBertForMaskedLM(cfg), _lm_batch(batch_size, seq_len or 16, 128, torch.Generator().manual_seed(0))


def convnext(batch_size=4, seq_len=None):
    tf = _tf()
    torch.manual_seed(0)
    cfg = tf.ConvNextConfig(num_channels=3, num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10,
                            image_size=32)
    gen = torch.Generator().manual_seed(0)
    batch = {"pixel_values": torch.randn(batch_size, 3, 32, 32, generator=gen),
             "labels": torch.randint(0, 10, (batch_size,), generator=gen)}
    return tf.ConvNextForImageClassification(cfg), batch


FAMILIES = ("qwen2", "mistral", "t5", "distilbert", "convnext", "mixtral", "qwen2_moe", "mamba")
