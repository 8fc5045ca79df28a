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


def mixtral_router(batch_size=4, seq_len=16):
    """Mixtral as it trains: its router's load-balancing loss added (at transformers' weight),
    computed over the tokens of the batch it sees, so not a mean over samples."""
    return mixtral(batch_size, seq_len, output_router_logits=True)


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


def _images(batch_size, labels, side=32):
    gen = torch.Generator().manual_seed(0)
    return {"pixel_values": torch.randn(batch_size, 3, side, side, generator=gen),
            "labels": torch.randint(0, labels, (batch_size,), generator=gen)}


def swin(batch_size=4, seq_len=None):
    """Shifted-window attention; its heads are a list, one count per stage of the model."""
    tf = _tf()
    torch.manual_seed(0)
    cfg = tf.SwinConfig(image_size=32, patch_size=4, num_channels=3, embed_dim=16, depths=[1, 1], num_heads=[1, 2],
                        window_size=2, num_labels=5)
    return tf.SwinForImageClassification(cfg), _images(batch_size, 5)


def segformer(batch_size=4, seq_len=None):
    """A hierarchical vision transformer with per-stage heads, sizes and reduction ratios."""
    tf = _tf()
    torch.manual_seed(0)
    cfg = tf.SegformerConfig(num_channels=3, num_encoder_blocks=2, depths=[2, 2], sr_ratios=[2, 1],
                             hidden_sizes=[8, 16], patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2],
                             mlp_ratios=[2, 2], num_labels=5, decoder_hidden_size=16)
    return tf.SegformerForImageClassification(cfg), _images(batch_size, 5)


def wav2vec2(batch_size=4, seq_len=None):
    """Speech: a convolutional feature encoder, transformer layers, and the CTC loss over
    characters (label sequences padded with -100), with dropout; LayerDrop and SpecAugment off,
    as a pipeline needs them (they choose in Python at random what runs, which no trace follows)."""
    tf = _tf()
    torch.manual_seed(0)
    cfg = tf.Wav2Vec2Config(vocab_size=32, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                            intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, ctc_loss_reduction="mean",
                            layerdrop=0.0, mask_time_prob=0.0)
    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(1, 32, (batch_size, 6), generator=gen)
    labels[::2, 4:] = -100  # shorter transcripts, padded
    return tf.Wav2Vec2ForCTC(cfg), {"input_values": torch.randn(batch_size, 800, generator=gen), "labels": labels}


def opt(batch_size=4, seq_len=16):
    """A decoder LM whose dropout is functional: `nn.functional.dropout(x, p=self.dropout)`."""
    tf = _tf()
    torch.manual_seed(0)
    cfg = tf.OPTConfig(vocab_size=128, hidden_size=64, ffn_dim=128, num_hidden_layers=4, num_attention_heads=4,
                       max_position_embeddings=256, word_embed_proj_dim=64)
    return tf.OPTForCausalLM(cfg), _lm_batch(batch_size, seq_len or 16, 128, torch.Generator().manual_seed(0))


def gpt_neox(batch_size=4, seq_len=16):
    """Parallel attention and MLP in one block, partial rotary embeddings."""
    tf = _tf()
    torch.manual_seed(0)
    cfg = tf.GPTNeoXConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, max_position_embeddings=256, rotary_pct=0.5)
    return tf.GPTNeoXForCausalLM(cfg), _lm_batch(batch_size, seq_len or 16, 128, torch.Generator().manual_seed(0))


def roberta(batch_size=4, seq_len=16):
    tf = _tf()
    torch.manual_seed(0)
    cfg = tf.RobertaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, max_position_embeddings=256)
    batch = _lm_batch(batch_size, seq_len or 16, 128, torch.Generator().manual_seed(0))
    batch["input_ids"] = batch["input_ids"].clamp(min=3)  # 1 is RoBERTa's padding id
    return tf.RobertaForMaskedLM(cfg), batch


def phi(batch_size=4, seq_len=16):
    tf = _tf()
    torch.manual_seed(0)
    cfg = tf.PhiConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, max_position_embeddings=256)
    return tf.PhiForCausalLM(cfg), _lm_batch(batch_size, seq_len or 16, 128, torch.Generator().manual_seed(0))


FAMILIES = ("qwen2", "mistral", "t5", "distilbert", "convnext", "mixtral", "qwen2_moe", "mamba", "swin", "segformer",
            "wav2vec2", "opt", "gpt_neox", "roberta", "phi", "mixtral_router")
