# Correct program (quiet batch quiet-r119a).
# Ported from PrimeIntellect-ai/prime (ZeroBand, INTELLECT-1's trainer):
#   src/zeroband/models/llama/model.py @ab7166e6c9847b931fb9a7635f42686db70343fa (seqlens_to_docs_tensor,
#     create_block_mask_from_seqlens, flex_attention_compiled, Attention.self_attention, Transformer.forward),
#   src/zeroband/data.py @f50de6c418d6db1e84eafc76203e9530e639c05a (FakeTokenizedDataset, SequencePackingDataSet,
#     collate_fn), src/zeroband/train.py (the grad-accumulation loop: seqlens -> block mask -> model -> CE).
# Pre-training on packed rows: the packer concatenates documents (each with its EOS as last label) up to
# seq_length, cutting the last one, and records each row's seqlens; the training step turns them into a
# FlexAttention BlockMask (causal AND same document) built once per batch and handed to every layer.
# Checked against a reference: every document run alone (block_mask=None, the model's SDPA is_causal path)
# gives the same logits and the packed loss equals the per-document one (and, on CUDA, so do its gradients).
import random
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset
from torch.nn.attention.flex_attention import create_block_mask, flex_attention, BlockMask, _DEFAULT_SPARSE_BLOCK_SIZE

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# compiled as the project does on GPU; on CPU (tests) flex runs eagerly, which is the same computation
_flex_attention_compiled = torch.compile(flex_attention, dynamic=False) if DEVICE == "cuda" else flex_attention


@torch.compiler.disable(recursive=False)
def flex_attention_compiled(q, k, v, block_mask: BlockMask) -> torch.Tensor:
    return _flex_attention_compiled(q, k, v, block_mask=block_mask)


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: Optional[int] = None
    vocab_size: int = -1
    multiple_of: int = 256
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000
    max_batch_size: int = 32
    max_seq_len: int = 2048
    depth_init: bool = True
    norm_type: str = "rmsnorm"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x.float()).type_as(x) * self.weight

    def reset_parameters(self):
        nn.init.ones_(self.weight)


def build_norm(norm_type: str, dim: int, eps: float = 1e-6):
    if norm_type == "rmsnorm":
        return RMSNorm(dim, eps=eps)
    raise NotImplementedError(f"Unknown norm_type: '{norm_type}'")


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    ndim = x.ndim
    seqlen = x.shape[1]
    freqs_cis = freqs_cis[0:seqlen]
    assert freqs_cis.shape == (seqlen, x.shape[-1])
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq, xk, freqs_cis) -> Tuple[torch.Tensor, torch.Tensor]:
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        torch.unsqueeze(x, dim=3)
        .expand(bs, slen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, slen, n_kv_heads * n_rep, head_dim)
    )


def seqlens_to_docs_tensor(seqlens: list[torch.Tensor]) -> torch.Tensor:
    """seqlens = [tensor([2,2,1]), tensor([2,2,1])] -> docs = [[0,0,1,1,2], [0,0,1,1,2]]"""
    return torch.stack([torch.repeat_interleave(torch.arange(len(seq), device=seq.device), seq) for seq in seqlens])


def create_block_mask_from_seqlens(seqlens: list[torch.Tensor]) -> BlockMask:
    docs = seqlens_to_docs_tensor(seqlens).to(DEVICE)
    batch_size, max_seq_len = docs.shape

    def document_causal_mask(b, h, q_idx, kv_idx):
        causal_mask = q_idx >= kv_idx
        document_mask = docs[b, q_idx] == docs[b, kv_idx]
        return causal_mask & document_mask

    return create_block_mask(
        document_causal_mask,
        batch_size,
        None,
        max_seq_len,
        max_seq_len,
        device=DEVICE,
        _compile=DEVICE == "cuda",
        BLOCK_SIZE=max_seq_len if max_seq_len < _DEFAULT_SPARSE_BLOCK_SIZE else _DEFAULT_SPARSE_BLOCK_SIZE,
    )


class Attention(nn.Module):
    def __init__(self, model_args: ModelArgs):
        super().__init__()
        self.n_heads = model_args.n_heads
        self.n_kv_heads = model_args.n_heads if model_args.n_kv_heads is None else model_args.n_kv_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = model_args.dim // model_args.n_heads
        self.wq = nn.Linear(model_args.dim, model_args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(model_args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(model_args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(model_args.n_heads * self.head_dim, model_args.dim, bias=False)

    def init_weights(self, init_std: float):
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

    def forward(self, x, freqs_cis, block_mask: BlockMask | None = None):
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)

        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)

        keys = repeat_kv(xk, self.n_rep)
        values = repeat_kv(xv, self.n_rep)

        xq = xq.transpose(1, 2)  # (bs, n_local_heads, seqlen, head_dim)
        xk = keys.transpose(1, 2)
        xv = values.transpose(1, 2)

        output = self.self_attention(xq, xk, xv, block_mask)

        output = output.view(bs, seqlen, -1)
        return self.wo(output)

    def _sdpa_attention(self, xq, xk, xv) -> torch.Tensor:
        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        return output.transpose(1, 2).contiguous()

    def _flex_attention_with_seqlens(self, xq, xk, xv, block_mask: BlockMask) -> torch.Tensor:
        output = flex_attention_compiled(xq, xk, xv, block_mask=block_mask)
        return output.transpose(1, 2).contiguous()

    def self_attention(self, xq, xk, xv, block_mask: BlockMask | None = None) -> torch.Tensor:
        if block_mask is not None:
            return self._flex_attention_with_seqlens(xq, xk, xv, block_mask)
        else:
            return self._sdpa_attention(xq, xk, xv)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, multiple_of: int, ffn_dim_multiplier: Optional[float]):
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        if ffn_dim_multiplier is not None:
            hidden_dim = int(ffn_dim_multiplier * hidden_dim)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float):
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, model_args: ModelArgs):
        super().__init__()
        self.attention = Attention(model_args)
        self.feed_forward = FeedForward(
            dim=model_args.dim,
            hidden_dim=4 * model_args.dim,
            multiple_of=model_args.multiple_of,
            ffn_dim_multiplier=model_args.ffn_dim_multiplier,
        )
        self.layer_id = layer_id
        self.num_layers = model_args.n_layers
        self.attention_norm = build_norm(model_args.norm_type, dim=model_args.dim, eps=model_args.norm_eps)
        self.ffn_norm = build_norm(model_args.norm_type, dim=model_args.dim, eps=model_args.norm_eps)
        if model_args.depth_init:
            self.weight_init_std = 0.02 / (2 * (self.layer_id + 1)) ** 0.5
        else:
            self.weight_init_std = 0.02 / (2 * self.num_layers) ** 0.5

    def forward(self, x, freqs_cis, block_mask: BlockMask | None = None):
        h = x + self.attention(self.attention_norm(x), freqs_cis, block_mask=block_mask)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self):
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)


class Transformer(nn.Module):
    def __init__(self, model_args: ModelArgs):
        super().__init__()
        self.model_args = model_args
        self.vocab_size = model_args.vocab_size
        self.n_layers = model_args.n_layers
        self.tok_embeddings = nn.Embedding(model_args.vocab_size, model_args.dim)
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=True)
        self.layers = torch.nn.ModuleDict()
        for layer_id in range(model_args.n_layers):
            self.layers[str(layer_id)] = TransformerBlock(layer_id, model_args)
        self.norm = build_norm(model_args.norm_type, dim=model_args.dim, eps=model_args.norm_eps)
        self.output = nn.Linear(model_args.dim, model_args.vocab_size, bias=False)
        self.init_weights()

    def init_weights(self):
        with torch.device(self.freqs_cis.device):
            self.freqs_cis = self._precompute_freqs_cis()
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        self.norm.reset_parameters()
        final_out_std = self.model_args.dim**-0.5
        cutoff_factor = 3
        nn.init.trunc_normal_(
            self.output.weight,
            mean=0.0,
            std=final_out_std,
            a=-cutoff_factor * final_out_std,
            b=cutoff_factor * final_out_std,
        )

    def _precompute_freqs_cis(self) -> torch.Tensor:
        return precompute_freqs_cis(
            self.model_args.dim // self.model_args.n_heads,
            self.model_args.max_seq_len * 2,
            self.model_args.rope_theta,
        )

    def forward(self, tokens: torch.Tensor, block_mask: BlockMask | None = None):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis, block_mask=block_mask)
        h = self.norm(h)
        return self.output(h).float()


# ---- data (src/zeroband/data.py) ----
TEST_VOCAB_SIZE = 1024


class FakeTokenizedDataset(IterableDataset):
    """This is a dummy dataset that generates random sequences of length seq_len and vocab_size"""

    def __init__(self, seq_len: int, vocab_size: int):
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        assert vocab_size > 3, "Vocab size must be greater than 3"

    def __iter__(self):
        while True:
            len_ = random.randint(1, self.seq_len)
            input_ids = torch.randint(3, self.vocab_size, (len_,)).tolist()
            yield {"input_ids": input_ids}


class SequencePackingDataSet(IterableDataset):
    def __init__(self, dataset, max_seq_length: int, eos_token: int):
        self.dataset = dataset
        self.max_seq_length = max_seq_length
        self.eos_token = eos_token
        self.inputs_ids, self.labels, self.seqlens = [], [], []

    def __iter__(self):
        for og_sample in self.dataset:
            og_sample: list[int] = og_sample["input_ids"]

            og_sample = og_sample + [self.eos_token]
            sample_inputs_ids = og_sample[:-1]
            sample_labels = og_sample[1:]

            token_remaining = self.max_seq_length - len(self.inputs_ids)

            if len(sample_inputs_ids) < token_remaining:
                self.inputs_ids.extend(sample_inputs_ids)
                self.labels.extend(sample_labels)
                self.seqlens.append(len(sample_inputs_ids))
            else:
                self.inputs_ids.extend(sample_inputs_ids[:token_remaining])
                self.labels.extend(sample_labels[:token_remaining])
                self.seqlens.append(token_remaining)

                data = {
                    "input_ids": torch.Tensor(self.inputs_ids).to(dtype=torch.long),
                    "labels": torch.Tensor(self.labels).to(dtype=torch.long),
                    "seqlens": self.seqlens,
                }
                self.inputs_ids, self.labels, self.seqlens = [], [], []
                yield data


def collate_fn(samples):
    assert samples[0].keys() == {"input_ids", "labels", "seqlens"}
    inputs_ids, labels, seqlens = [], [], []
    for sample in samples:
        inputs_ids.append(sample["input_ids"])
        labels.append(sample["labels"])
        seqlens.append(torch.Tensor(sample["seqlens"]).long())
    return {"input_ids": torch.stack(inputs_ids, dim=0), "labels": torch.stack(labels, dim=0), "seqlens": seqlens}


# ---- reference: each packed document run on its own ----
def per_document_reference(model, input_ids, labels, seqlens):
    logits_rows, loss_sum = [], 0.0
    for row in range(input_ids.shape[0]):
        pieces, start = [], 0
        for n in seqlens[row].tolist():
            doc = input_ids[row : row + 1, start : start + n]
            doc_logits = model(tokens=doc)  # block_mask=None: SDPA is_causal over this document alone
            pieces.append(doc_logits)
            loss_sum = loss_sum + F.cross_entropy(doc_logits[0], labels[row, start : start + n], reduction="sum")
            start += n
        assert start == input_ids.shape[1]
        logits_rows.append(torch.cat(pieces, dim=1))
    return torch.cat(logits_rows, dim=0), loss_sum / input_ids.numel()


def main():
    random.seed(0)
    torch.manual_seed(0)
    seq_length, batch_size, gradient_accumulation_steps, total_steps = 256, 2, 1, 3
    eos_token_id = 2

    model_args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=TEST_VOCAB_SIZE,
                           multiple_of=32, max_seq_len=seq_length)
    model = Transformer(model_args).to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # short fake documents so that every packed row holds several of them
    train_dataset = FakeTokenizedDataset(seq_length // 3, TEST_VOCAB_SIZE)
    dataset = SequencePackingDataSet(train_dataset, seq_length, eos_token=eos_token_id)
    train_dataloader_iterator = iter(DataLoader(dataset, batch_size=batch_size, collate_fn=collate_fn))

    n_docs = 0
    for step in range(total_steps):
        loss_batch = 0
        for grad_acc_step in range(gradient_accumulation_steps):
            batch = next(train_dataloader_iterator)
            input_ids = batch["input_ids"].to(DEVICE)
            labels = batch["labels"].to(DEVICE)
            seqlens = [seqlen.to(DEVICE) for seqlen in batch["seqlens"]]
            block_mask = create_block_mask_from_seqlens(seqlens) if seqlens is not None else None

            # FlexAttention has no backward on CPU: there the packed forward is only checked, and the step's
            # gradients come from the same loss taken document by document (equal to it, as checked below).
            with torch.set_grad_enabled(DEVICE == "cuda"):
                logits = model(tokens=input_ids, block_mask=block_mask).contiguous()
                flatten_logits = logits.reshape(-1, logits.size(-1))  # b seq vocab -> (b * seq) vocab
                flatten_labels = labels.reshape(-1)  # b seq -> (b * seq)
                ce_loss = F.cross_entropy(flatten_logits, flatten_labels)

            # check: packed forward and loss against the documents run one by one
            ref_logits, ref_loss = per_document_reference(model, input_ids, labels, seqlens)
            err = (logits - ref_logits).abs().max().item()
            assert err < 1e-4, (step, grad_acc_step, err)
            assert torch.allclose(ce_loss, ref_loss, atol=1e-5), (ce_loss.item(), ref_loss.item())
            if DEVICE == "cuda" and step == 0 and grad_acc_step == 0:
                ref_grads = torch.autograd.grad(ref_loss, list(model.parameters()), retain_graph=True)
                grads = torch.autograd.grad(ce_loss, list(model.parameters()), retain_graph=True)
                gerr = max((g - r).abs().max().item() for g, r in zip(grads, ref_grads))
                assert gerr < 1e-4, gerr
            if DEVICE != "cuda":
                ce_loss = ref_loss
            n_docs += sum(len(s) for s in seqlens)

            loss = ce_loss / gradient_accumulation_steps
            loss.backward()
            loss_batch += loss.detach().clone()

        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        print(f"step: {step + 1}, loss: {loss_batch.item():.4f}, max |packed - per-document| logits: {err:.2e}")

    print(f"ok: {n_docs} packed documents matched their own runs")


if __name__ == "__main__":
    main()
