"""
A compact modern GPT, in the spirit of nanoGPT and nanochat, shaped for Trainium's 128x128 TensorEngine.

Architecture (the Trainium Frontier baseline's choices):
- token embedding, RMSNorm (no learnable weight) before every sub-block and on the embedding
- rotary position embeddings (RoPE) on q and k, then QK-norm
- grouped-query attention: n_kv_head key/value heads shared by n_head query heads
- MLP with ReLU^2 (or GELU / SwiGLU), no biases anywhere
- untied lm_head, logits squashed by a tanh softcap
- vocab padded to a multiple of 128 so the head's matmul tiles evenly

Optional levers competitors measured on Trn2 (all off by default; train.py's --preset=frontier turns them on):
value embeddings with gates, residual/x0 scalars, a multi-token-prediction auxiliary loss, and a chunked
softcap cross-entropy that never holds the (tokens, vocab) fp32 logits. Also off by default: sliding-window
attention on some layers (window_pattern, nanochat's per-layer S/L pattern).

Attention, MLP and norm run through kernels.py, which picks NKI kernels or PyTorch.
"""
import math
from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels


TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def opt(default, help, bounds=None, above=None, choices=None, resumable=False):
    """A config field, declared once: its default, its --help text, the (low, high) it must lie in (inclusive,
    high None for no bound) or the number it must exceed (`above`), or the values it may take, and whether
    a resumed run may change it without becoming another run. Parsing, --help, validation and the resume
    check all read these."""
    metadata = {"help": help, "resumable": resumable}
    for key, rule in (("bounds", bounds), ("above", above), ("choices", choices)):
        if rule is not None:
            metadata[key] = rule
    return field(default=default, metadata=metadata)


def field_problems(config, prefix=""):
    """Each field's type, then its range or choices as its `opt` declares them: one line per problem, the
    field named as prefix + name ("--" for a flag)."""
    problems = []
    for f in fields(config):
        value, kind, name = getattr(config, f.name), type(f.default), prefix + f.name
        low, high = f.metadata.get("bounds", (None, None))
        above, choices = f.metadata.get("above"), f.metadata.get("choices")
        if not isinstance(value, (int, float) if kind is float else kind) or (kind is not bool and isinstance(value, bool)):
            problems.append(f"{name}={value!r} must be {TYPE_NAMES[kind]}")
        elif low is not None and not (low <= value and (high is None or value <= high) and math.isfinite(value)):
            problems.append(f"{name}={value} must be " + (f"between {low} and {high}" if high is not None else f">= {low}"))
        elif above is not None and not (value > above and math.isfinite(value)):
            problems.append(f"{name}={value} must be " + (f"> {above}" if above else "positive"))
        elif choices and value not in choices:
            problems.append(f"{name}={value!r}: use {' or '.join(choices)}")
    return problems


@dataclass
class GPTConfig:
    sequence_len: int = opt(256, "context length in tokens", above=0)
    vocab_size: int = opt(257, "tokenizer vocab (set from --tokenizer); embedding and head padded to a multiple of 128", above=0)
    n_layer: int = opt(4, "transformer blocks", above=0)
    n_head: int = opt(2, "query heads; head_dim = n_embd / n_head", above=0)
    n_kv_head: int = opt(0, "key/value heads, dividing n_head (grouped-query attention when fewer); 0 = n_head", bounds=(0, None))
    n_embd: int = opt(128, "model width", above=0)
    mlp: str = opt("relu2", "MLP activation: relu2 | leaky_relu2 | gelu | swiglu", choices=kernels.MLP_ACTIVATIONS)
    mlp_hidden: int = opt(0, "MLP hidden width; 0 = 4 * n_embd (swiglu: 8/3 * n_embd rounded up to 128)", bounds=(0, None))
    rope_base: float = opt(10000.0, "RoPE base frequency (10000 is usual)", above=1)
    logit_softcap: float = opt(15.0, "logits = cap * tanh(logits / cap); 0 disables", bounds=(0, None))
    window_pattern: str = opt("L", "attention window per layer, the pattern tiled over the layers, the last layer "
                              "always L: L = the whole context, S = the last sequence_len/4 tokens rounded up to "
                              "128 (nanochat's; it uses SSSL)")
    kernels: str = opt("auto", "auto (NKI on Trainium where the shapes fit and the cost model expects it faster) | nki "
                       "(NKI or an error) | torch (never NKI) | prefer (NKI wherever it fits); or per op, e.g. "
                       "attention:nki,mlp:torch (ops: " + ", ".join(kernels.KERNEL_OPS) + ")")
    # initialisation
    wte_init_std: float = opt(1.0, "std of the token embedding's normal init", above=0)
    matrix_init_scale: float = opt(1.0, "multiplies the 1/sqrt(fan_in) init of q, k, v and the MLP's input matrices", above=0)
    # levers (see the module docstring); their schedules and optimizers live in train.py
    value_embeds: bool = opt(False, "a gated per-token value table on alternate layers (the last always)")
    residual_scalars: bool = opt(False, "learned per-layer x = resid[i] * x + x0[i] * embedding before each block")
    mtp_extra: int = opt(0, "training loss also scores tokens t+2 .. t+1+mtp_extra from the same logits", bounds=(0, None))
    loss_chunks: int = opt(0, "0: plain cross-entropy; N: fused softcap cross-entropy over N row chunks", bounds=(0, None))

    def __post_init__(self):
        # the one place n_kv_head's "same as n_head" is resolved: every config is built through here, and
        # checkpoints store the resolved number
        if self.n_kv_head == 0:
            self.n_kv_head = self.n_head

    @property
    def short_window(self):
        """Earlier tokens an S layer's queries see besides their own: a quarter of the context, rounded up to
        the attention kernels' 128-key tile (nanochat's rule, there for FA3's tile)."""
        return math.ceil(self.sequence_len / 4 / 128) * 128

    def attention_windows(self):
        """Per layer, the earlier tokens each query sees (FA3's left window_size: keys i - window .. i), or
        None for the whole context: window_pattern tiled over the layers, the last layer always whole."""
        windows = [self.short_window if self.window_pattern[i % len(self.window_pattern)] == "S" else None
                   for i in range(self.n_layer)]
        windows[-1] = None
        return windows

    @property
    def head_dim(self):
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self):
        return math.ceil(self.vocab_size / 128) * 128

    @property
    def hidden_dim(self):
        if self.mlp_hidden:
            return self.mlp_hidden
        if self.mlp == "swiglu":  # two input projections: keep the parameter count of a 4x MLP
            return math.ceil(8 * self.n_embd / 3 / 128) * 128
        return 4 * self.n_embd

    def validate(self):
        """Fail fast, with the fix, on values the model cannot take: each field's own rule (its `opt`) first,
        as the rules between fields below divide by them."""
        problems = field_problems(self)
        if problems:
            raise ValueError("invalid model config: " + "; ".join(problems))
        if self.n_embd % self.n_head:
            problems.append(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head} (head_dim = n_embd / n_head)")
        if self.n_head % self.n_kv_head:
            problems.append(f"n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head} (set n_kv_head to a divisor of n_head, or 0 for n_head)")
        elif self.n_embd % self.n_head == 0 and self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even for RoPE")
        try:
            modes = kernels.parse_kernels(self.kernels)
        except ValueError as e:
            problems.append(str(e))
            modes = {}
        attention_mode, on_nki = modes.get("attention"), [op for op, mode in modes.items() if mode == "nki"]
        if on_nki and kernels.NKI_IMPORT_ERROR is not None:
            problems.append(f"kernels={self.kernels!r} runs {', '.join(on_nki)} on NKI, which is not usable here "
                            f"({kernels.NKI_IMPORT_ERROR}); use --kernels=auto or torch, or run the kernels under the "
                            "CPU emulator: NKI_EMULATOR=1 python train.py ... (docs/kernels.md)")
        if attention_mode == "nki" and self.n_embd % self.n_head == 0 and self.head_dim > kernels.ATTENTION_MAX_HEAD_DIM:
            problems.append(f"kernels='nki' needs head_dim <= {kernels.ATTENTION_MAX_HEAD_DIM} (NKI attention contracts "
                            f"it in two 128-partition pieces), got {self.head_dim}; raise n_head or use kernels='auto'")
        if attention_mode == "nki" and self.sequence_len % 128:
            problems.append(f"kernels='nki' needs sequence_len to be a multiple of 128 (NKI attention tiles), "
                            f"got {self.sequence_len}; or use kernels='auto'")
        if not self.window_pattern or set(self.window_pattern) - set(WINDOW_KINDS):
            problems.append(f"window_pattern={self.window_pattern!r} must be letters {' and '.join(WINDOW_KINDS)} "
                            "(L: the whole context, S: a short window), e.g. SSSL")
        if self.value_embeds and self.n_embd < VE_GATE_CHANNELS:
            problems.append(f"value_embeds gates read the first {VE_GATE_CHANNELS} channels; n_embd={self.n_embd} is smaller")
        if self.mtp_extra >= self.sequence_len:
            problems.append(f"mtp_extra={self.mtp_extra} must be below sequence_len={self.sequence_len} (extra future tokens scored)")
        if problems:
            raise ValueError("invalid model config: " + "; ".join(problems))


VE_GATE_CHANNELS = 32  # a value embedding's gate reads this many residual channels (nanochat's choice)
WINDOW_KINDS = ("L", "S")  # window_pattern's letters: long (the whole context) and short


def has_value_embed(layer, n_layer):
    """Alternate layers, always including the last (nanochat, and karpathy/autoresearch train.py has_ve)."""
    return layer % 2 == (n_layer - 1) % 2


def norm(x, mode="auto"):
    return kernels.rms_norm(x, mode=mode)


def rotary_tables(seq_len, head_dim, base):
    """cos/sin of shape (seq_len, head_dim // 2): position t rotates channel pair i by t * base^(-2i/d)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


class CausalSelfAttention(nn.Module):
    def __init__(self, config, ve=False, window=None):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.window = window  # earlier tokens each query sees, None for all (GPTConfig.attention_windows)
        self.kernels = kernels.parse_kernels(config.kernels)  # {op: mode}, parsed once, for every call
        self.c_q = nn.Linear(config.n_embd, config.n_head * config.head_dim, bias=False)
        self.c_k = nn.Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=False)
        self.c_v = nn.Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=False)
        self.c_proj = nn.Linear(config.n_head * config.head_dim, config.n_embd, bias=False)
        self.ve_gate = nn.Linear(VE_GATE_CHANNELS, config.n_kv_head, bias=False) if ve else None

    def forward(self, x, cos, sin, ve=None):
        B, T, C = x.shape
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        if ve is not None:  # each kv head mixes in the token's own value vector, by a gate in (0, 2) that starts at 1
            gate = 2 * torch.sigmoid(self.ve_gate(x[..., :VE_GATE_CHANNELS]))  # (B, T, Hkv)
            # the table is fp32 and autocast does not touch products: cast back, or v (and so attention) leaves bf16
            v = v + (gate.unsqueeze(-1) * ve.view(B, T, self.n_kv_head, self.head_dim)).type_as(v)
        v = v.transpose(1, 2)
        # RoPE, then QK-norm (it bounds the logits without a tuned scale): (B, T, H*D) -> (B, H, T, D)
        q = kernels.rope_norm(self.c_q(x), cos, sin, self.n_head, mode=self.kernels)
        k = kernels.rope_norm(self.c_k(x), cos, sin, self.n_kv_head, mode=self.kernels)
        y = kernels.attention(q, k, v, mode=self.kernels, window=self.window)  # (B, H, T, D)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.activation, self.kernels = config.mlp, kernels.parse_kernels(config.kernels)
        self.c_fc = nn.Linear(config.n_embd, config.hidden_dim, bias=False)
        self.c_gate = nn.Linear(config.n_embd, config.hidden_dim, bias=False) if config.mlp == "swiglu" else None
        self.c_proj = nn.Linear(config.hidden_dim, config.n_embd, bias=False)

    def forward(self, x):
        w_gate = self.c_gate.weight if self.c_gate is not None else None
        return kernels.mlp(x, self.c_fc.weight, self.c_proj.weight, self.activation, w_gate, mode=self.kernels)


class Block(nn.Module):
    def __init__(self, config, ve=False, norm_output=True, window=None):
        super().__init__()
        self.attn = CausalSelfAttention(config, ve, window)
        self.mlp = MLP(config)
        self.kernels = kernels.parse_kernels(config.kernels)
        self.norm_output = norm_output  # whether what reads the block's output first is its norm

    def forward(self, x, cos, sin, ve=None, normed=None):
        """The new residual stream and, with norm_output, its norm; else None.

        x: the residual stream; normed: norm(x) if the block before made it. The norm returned is the next
        block's input, or the final norm. A residual add followed by a norm of its sum runs as one op,
        kernels.add_rms_norm (one pass over the rows on NKI)."""
        normed = norm(x, self.kernels) if normed is None else normed
        x, normed = kernels.add_rms_norm(x, self.attn(normed, cos, sin, ve), mode=self.kernels)
        if not self.norm_output:
            return x + self.mlp(normed), None
        return kernels.add_rms_norm(x, self.mlp(normed), mode=self.kernels)


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        config.validate()
        self.config = config
        self.wte = nn.Embedding(config.padded_vocab_size, config.n_embd)
        ve_layers = [i for i in range(config.n_layer) if config.value_embeds and has_value_embed(i, config.n_layer)]
        # the residual scalars rescale x between blocks, so there only the last block hands on the norm of its output
        last = config.n_layer - 1
        self.blocks = nn.ModuleList([Block(config, i in ve_layers, not config.residual_scalars or i == last, window)
                                     for i, window in enumerate(config.attention_windows())])
        kv_dim = config.n_kv_head * config.head_dim
        self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(config.padded_vocab_size, kv_dim) for i in ve_layers})
        if config.residual_scalars:
            self.resid_lambdas = nn.Parameter(torch.ones(config.n_layer))
            self.x0_lambdas = nn.Parameter(torch.zeros(config.n_layer))
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        self.kernels = kernels.parse_kernels(config.kernels)
        self.kernels_ran = None  # per op, what ran in training (kernels.preview_fallbacks); checkpoints keep it
        # weights of the extra MTP targets t+2, t+3, ...: a buffer that train.py rewrites in place as the fade
        # goes on, so a compiled step reads a tensor instead of specialising on a changing Python number
        self.register_buffer("extra_loss_weights", torch.zeros(config.mtp_extra), persistent=False)
        cos, sin = rotary_tables(config.sequence_len, config.head_dim, config.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """nanochat's init: a normal embedding (std wte_init_std, 1 by default), uniform matrices of std
        matrix_init_scale / sqrt(fan_in), zero output projections (each block starts as the identity), and a
        near-zero head so the first loss is ln(vocab)."""
        c = self.config
        nn.init.normal_(self.wte.weight, std=c.wte_init_std)
        nn.init.normal_(self.lm_head.weight, std=0.001)
        for block in self.blocks:
            for linear in (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.mlp.c_fc, block.mlp.c_gate):
                if linear is not None:
                    bound = c.matrix_init_scale * math.sqrt(3.0 / linear.in_features)  # uniform, std scale/sqrt(fan_in)
                    nn.init.uniform_(linear.weight, -bound, bound)
            nn.init.zeros_(block.attn.c_proj.weight)
            nn.init.zeros_(block.mlp.c_proj.weight)
            if block.attn.ve_gate is not None:
                nn.init.zeros_(block.attn.ve_gate.weight)  # gates start at 2 * sigmoid(0) = 1
        for table in self.value_embeds.values():
            bound = math.sqrt(3.0 / c.n_embd)
            nn.init.uniform_(table.weight, -bound, bound)
        if c.residual_scalars:  # start as the plain residual stream plus a little of the embedding (nanochat: 1, 0.1)
            self.resid_lambdas.fill_(1.0)
            self.x0_lambdas.fill_(0.1)

    def forward(self, idx, targets=None, loss_reduction="mean"):
        """idx: (B, T) token ids; T may exceed sequence_len (the rotary tables grow), which training never does.

        Without targets: logits (B, T, vocab_size). With targets (B, T): the mean cross-entropy in nats,
        or with loss_reduction="none" the per-token loss (B, T), which bits-per-byte needs.
        Targets equal to -1 are ignored. In training with mtp_extra > 0 the mean loss adds the weighted
        losses of the later targets (multi-token prediction); evaluation always scores the next token only.
        """
        B, T = idx.shape
        if T > self.rope_cos.size(0):  # longer than training's context (evaluation): extend the tables once
            cos, sin = rotary_tables(T, self.config.head_dim, self.config.rope_base)
            self.rope_cos, self.rope_sin = cos.to(self.rope_cos.device), sin.to(self.rope_sin.device)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        c = self.config
        x = x0 = norm(self.wte(idx), self.kernels)
        normed = None  # norm(x), when the block before made it
        for i, block in enumerate(self.blocks):
            if c.residual_scalars:  # (then normed is None: only the last block makes it)
                x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0
            ve = self.value_embeds[str(i)](idx) if str(i) in self.value_embeds else None
            x, normed = block(x, cos, sin, ve, normed)
        x = normed
        if targets is not None and (c.mtp_extra or c.loss_chunks):
            return self.lever_loss(x, targets, loss_reduction)
        logits = self.lm_head(x)  # (B, T, padded vocab)
        if targets is not None:  # softcap and cross-entropy in one op (one pass over the logits on NKI)
            return kernels.softcap_cross_entropy(logits, targets, c.logit_softcap, c.vocab_size, loss_reduction,
                                                 self.kernels)
        logits = logits[..., : c.vocab_size].float()  # padding columns never win
        if c.logit_softcap:
            logits = c.logit_softcap * torch.tanh(logits / c.logit_softcap)
        return logits

    def lever_loss(self, x, targets, loss_reduction):
        """Cross-entropy for the levers: the next token, plus (training only) the tokens mtp_extra further
        on, all scored from the same logits, the later ones weighted by the extra_loss_weights buffer. Shapes
        are fixed: a target past the row's end is -1, never a shorter tensor."""
        c = self.config
        extra = c.mtp_extra if self.training and loss_reduction == "mean" else 0
        later = [F.pad(targets[:, j:], (0, j), value=-1) for j in range(1, extra + 1)]  # t+1+j, -1 past the end
        stacked = torch.stack([targets, *later], dim=-1)  # (B, T, 1 + extra)
        head = self.lm_head.weight[: c.vocab_size]
        if c.loss_chunks:
            nll = chunked_softcap_nll(x.flatten(0, 1), head, stacked.flatten(0, 1), c.logit_softcap, c.loss_chunks)
            nll = nll.view(stacked.shape)
        else:
            nll = softcap_nll(x @ head.T, stacked, c.logit_softcap)
        if loss_reduction == "none":
            return nll[..., 0]
        per_target = nll.sum(dim=(0, 1)) / (stacked >= 0).sum(dim=(0, 1)).clamp_min(1)  # mean over valid targets
        weights = torch.cat([torch.ones(1, device=nll.device), self.extra_loss_weights])[: 1 + extra]
        return (per_target * weights).sum()

    def num_params(self, matmul_only=False):
        """All parameters, or only those that multiply activations in a matmul (everything except the
        embedding and value-embedding tables, which are lookups)."""
        if not matmul_only:
            return sum(p.numel() for p in self.parameters())
        params = (p for n, p in self.named_parameters() if n != "wte.weight" and not n.startswith("value_embeds."))
        return sum(p.numel() for p in params)

    def flops_per_token(self):
        """Training FLOPs per token (forward + backward), the PaLM appendix B formula:

            6 * N_matmul + 12 * n_layer * n_head * head_dim * sequence_len

        6 * N_matmul: each matmul weight costs 2 FLOPs per token forward and 4 backward (grads of input
        and weight); the padded head counts as computed. The attention term covers q @ k^T and p @ v at
        full (non-causal) length, as PaLM and nanoGPT count it, so it over-counts the useful causal work
        by up to 2x on that term; a layer with a window counts the window instead of sequence_len (as
        nanochat's estimate_flops). Recomputation and elementwise ops are not counted.
        """
        c = self.config
        keys = sum(c.sequence_len if w is None else min(w, c.sequence_len) for w in c.attention_windows())
        return 6 * self.num_params(matmul_only=True) + 12 * c.n_head * c.head_dim * keys

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        """Autoregressive sampling: idx (B, T) -> (B, T + max_new_tokens); temperature 0 picks the argmax.

        Every forward has the one shape (B, sequence_len), so a device that compiles each new shape (Neuron)
        compiles once: the context is the last sequence_len tokens, right-padded while shorter (the model is
        causal, so padding after the last token changes none of its logits). Sampling runs on the CPU with
        `generator` (a CPU torch.Generator; device generators are not available everywhere)."""
        tokens, length = idx.cpu(), self.config.sequence_len
        for _ in range(max_new_tokens):
            context = tokens[:, -length:]
            window = F.pad(context, (0, length - context.size(1)))
            logits = self(window.to(self.lm_head.weight.device))[:, context.size(1) - 1, :].float().cpu()
            if temperature == 0:
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, -float("inf"))
                next_id = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            tokens = torch.cat([tokens, next_id], dim=1)
        return tokens.to(idx.device)


# -----------------------------------------------------------------------------
# cross-entropy over several targets per position, plain and chunked

def softcap_nll(logits, targets, cap):
    """logits (..., V), targets (..., K) with -1 = ignore: the negative log-likelihood (..., K) of each
    target under softcap(logits), in fp32; ignored targets give 0."""
    logits = logits.float()
    if cap:
        logits = cap * torch.tanh(logits / cap)
    picked = logits.gather(-1, targets.clamp_min(0))
    return (logits.logsumexp(dim=-1, keepdim=True) - picked) * (targets >= 0)


class ChunkedSoftcapNLL(torch.autograd.Function):
    """softcap_nll(x @ w.T, targets, cap) computed `chunks` rows at a time: forward keeps only the
    (N, K) losses and backward recomputes each chunk's logits, so the (N, V) fp32 logits, softmax and
    their gradient never exist at once (FrontierForge's fused chunked CE, -2.8% step time on Trn2,
    marker2601/trainium-simulator docs/FINDINGS.md). The chunk loop has a fixed trip count, so a
    compiled step unrolls it without data-dependent control flow."""

    @staticmethod
    def forward(ctx, x, w, targets, cap, chunks):
        ctx.save_for_backward(x, w, targets)
        ctx.cap, ctx.chunks = cap, chunks
        return torch.cat([softcap_nll(xc @ w.T, tc, cap) for xc, tc in zip(x.chunk(chunks), targets.chunk(chunks))])

    @staticmethod
    def backward(ctx, grad):
        x, w, targets = ctx.saved_tensors
        cap, chunks = ctx.cap, ctx.chunks
        grad_x, grad_w = [], torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        w_x = w.to(x.dtype)  # forward ran under autocast when x is bf16; backward runs outside it
        for xc, tc, gc in zip(x.chunk(chunks), targets.chunk(chunks), grad.chunk(chunks)):
            raw = (xc @ w_x.T).float()
            squash = torch.tanh(raw / cap) if cap else None
            probs = torch.softmax(cap * squash if cap else raw, dim=-1)
            gc = gc * (tc >= 0)  # d nll_k / d logits = softmax - onehot(target_k), for each valid target k
            d_logits = probs * gc.sum(dim=-1, keepdim=True)
            d_logits.scatter_add_(-1, tc.clamp_min(0), -gc)
            d_raw = d_logits * (1 - squash * squash) if cap else d_logits
            grad_x.append(d_raw.to(xc.dtype) @ w_x)
            grad_w += d_raw.T @ xc.float()
        return torch.cat(grad_x), grad_w.to(w.dtype), None, None, None


def chunked_softcap_nll(x, w, targets, cap, chunks):
    """x (N, C), w (V, C), targets (N, K) -> (N, K); see ChunkedSoftcapNLL."""
    return ChunkedSoftcapNLL.apply(x, w, targets, cap, chunks)
