"""Models used by the tests as a user's own (`module.path:factory`)."""

import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x):
        h = torch.relu(self.bn(self.fc1(x)))
        return self.fc2(h) + x[:, :1]  # a skip from the input to the output


def ctr_small(batch_size=16, seq_len=None):
    """hetplan's ctr-dnn with small tables (four of 2,000 rows, 22 of 100) and a small MLP."""
    from hetplan.zoo.models import ctr_dnn

    return ctr_dnn(batch_size, 0, 0, tables=(2000,) * 4 + (100,) * 22, hidden=(64, 32))


# The zoo's base-size models at a few of their layers: the same classes and widths, so the same
# pieces, boundaries and tied weights; each further layer repeats what these cut and carry.
def bert_base_short(batch_size=4, seq_len=16):
    """bert-base at 2 of its 12 layers."""
    from hetplan.zoo.models import bert

    return bert(batch_size, seq_len, 0, layers=2)


def vit_base_short(batch_size=4, seq_len=None):
    """vit-base at 2 of its 12 layers."""
    from hetplan.zoo.models import vit_base

    return vit_base(batch_size, 0, 0, layers=2)


def resnet50_short(batch_size=4, seq_len=None):
    """resnet50 with one bottleneck per stage but the first's two: each stage's first bottleneck
    projects its shortcut, the second of the first adds it as it is."""
    from hetplan.zoo.models import resnet50

    return resnet50(batch_size, 0, 0, depths=(2, 1, 1, 1))


def make(batch_size=4, seq_len=None):
    torch.manual_seed(0)
    return Tiny(), {"x": torch.randn(batch_size, 8)}


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = Gate()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(self.gate(x))


class Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # control flow on a value: torch.export cannot trace it
            return x
        return -x


def untraceable(batch_size=2, seq_len=None):
    return DataDependent(), {"x": torch.randn(batch_size, 4)}


class Hungry(nn.Module):
    """Asks for 1 PiB when it runs for real (tracing uses fake tensors and allocates nothing)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        big = x.new_zeros(2**48)
        return self.fc(x) + big[:1]


def hungry(batch_size=2, seq_len=None):
    return Hungry(), {"x": torch.randn(batch_size, 4)}


def broken(batch_size=4, seq_len=None):
    """A factory that fails, as a user's may while being written."""
    raise ValueError("no such checkpoint")


def sizeless():
    """A factory that takes no batch size."""
    return make()


def wav2vec2_ctc(batch_size=2, seq_len=None):
    """Speech with a CTC loss: the loss's shapes depend on the labels' values (data-dependent), so
    neither torch.export nor torch.fx traces the whole model."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.Wav2Vec2Config(vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                                      num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2, mask_time_prob=0.0,
                                      layerdrop=0.0, ctc_loss_reduction="mean", pad_token_id=0)
    gen = torch.Generator().manual_seed(0)
    batch = {"input_values": torch.randn(batch_size, 1600, generator=gen),
             "labels": torch.randint(1, 16, (batch_size, 12), generator=gen)}
    return transformers.Wav2Vec2ForCTC(cfg), batch


def mixtral_aux(batch_size=4, seq_len=16):
    """Mixtral with its router's load-balancing loss added to the loss: computed over the tokens
    of the batch it sees, so not a mean over samples."""
    from hf_families import mixtral

    return mixtral(batch_size, seq_len, output_router_logits=True, router_aux_loss_coef=1.0)


# Factories broken in the ways a user's are while being written: each must be one line.
def returns_none(batch_size=4, seq_len=None):
    return None


def returns_the_model_alone(batch_size=4, seq_len=None):
    return Tiny()


def batch_not_a_dict(batch_size=4, seq_len=None):
    return Tiny(), [torch.randn(batch_size, 8)]


def batch_of_the_wrong_shape(batch_size=4, seq_len=None):
    return Tiny(), {"x": torch.randn(batch_size, 5)}


def batch_without_a_batch_dimension(batch_size=4, seq_len=None):
    return Tiny(), {"x": torch.tensor(1.0)}


def not_a_module(batch_size=4, seq_len=None):
    return (lambda x: x), {"x": torch.randn(batch_size, 8)}


def exits(batch_size=4, seq_len=None):
    raise SystemExit(3)


def raises_keyboard_interrupt_like(batch_size=4, seq_len=None):
    raise RecursionError("maximum recursion depth exceeded")


def a_non_scalar_loss(batch_size=4, seq_len=None):
    return nn.Linear(8, 3), {"input": torch.randn(batch_size, 8)}


not_callable = 42


class Spatial(nn.Module):
    """Dropout2d, which is not an nn.Dropout: `--no-dropout` must reach it too."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.drop = nn.Dropout2d(0.5)

    def forward(self, x):
        return self.drop(self.conv(x)).mean()


def spatial_dropout(batch_size=4, seq_len=None):
    torch.manual_seed(0)
    return Spatial(), {"x": torch.randn(batch_size, 3, 8, 8)}
