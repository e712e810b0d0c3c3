# Correct program (quiet batch quiet-zw).
# Ported from facebookresearch/contriever @39fb2201450cdba1648183737ed56d6b1bc33778:
#   src/contriever.py (Contriever(BertModel), add_pooling_layer=False; forward: masked_fill of padded positions with
#     0 through ~attention_mask[..., None].bool(), "average" pooling = sum over tokens / attention_mask.sum(dim=1),
#     optional L2 normalisation),
#   src/data.py (add_bos_eos, build_mask: right padding with id 0 and a bool mask, Collator),
#   src/inbatch.py (InBatch.forward: query / passage embeddings, scores = einsum(q / temperature, k), cross entropy
#     against the diagonal).
# The model is a tiny BertConfig built in memory (random init, as load_retriever does with random_init). Queries and
# passages of unequal lengths are right-padded by build_mask; the bool mask goes to BertModel as its attention mask
# and again to the pooling, which zeroes pad rows and divides by the real lengths.
# Self-check: every query and passage alone, unpadded (mask of ones), through the same encoder; the mean of its
# hidden states is its reference embedding. Padded-batch embeddings (raw and normalised), the score matrix and the
# InBatch loss must match.
import sys
from collections import defaultdict
from types import SimpleNamespace

import torch
import torch.nn as nn
from transformers import BertConfig, BertModel

torch.manual_seed(0)


# --- src/contriever.py ---
class Contriever(BertModel):
    def __init__(self, config, pooling="average", **kwargs):
        super().__init__(config, add_pooling_layer=False)
        if not hasattr(config, "pooling"):
            self.config.pooling = pooling

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                normalize=False):
        model_output = super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
        )

        last_hidden = model_output["last_hidden_state"]
        last_hidden = last_hidden.masked_fill(~attention_mask[..., None].bool(), 0.0)

        if self.config.pooling == "average":
            emb = last_hidden.sum(dim=1) / attention_mask.sum(dim=1)[..., None]
        elif self.config.pooling == "cls":
            emb = last_hidden[:, 0]

        if normalize:
            emb = torch.nn.functional.normalize(emb, dim=-1)
        return emb


# --- src/data.py ---
def build_mask(tensors):
    maxlength = max([len(x) for x in tensors])
    returnmasks = []
    ids = []
    for k, x in enumerate(tensors):
        returnmasks.append(torch.tensor([1] * len(x) + [0] * (maxlength - len(x))))
        ids.append(torch.cat((x, torch.tensor([0] * (maxlength - len(x))))))
    ids = torch.stack(ids, dim=0).long()
    returnmasks = torch.stack(returnmasks, dim=0).bool()
    return ids, returnmasks


def add_bos_eos(x, bos_token_id, eos_token_id):
    if not isinstance(x, torch.Tensor):
        x = torch.Tensor(x)
    x = torch.cat([torch.tensor([bos_token_id]), x.clone().detach(), torch.tensor([eos_token_id])])
    return x


class Collator(object):
    def __init__(self, opt):
        self.opt = opt

    def __call__(self, batch_examples):
        batch = defaultdict(list)
        for example in batch_examples:
            for k, v in example.items():
                batch[k].append(v)

        q_tokens, q_mask = build_mask(batch["q_tokens"])
        k_tokens, k_mask = build_mask(batch["k_tokens"])

        batch["q_tokens"] = q_tokens
        batch["q_mask"] = q_mask
        batch["k_tokens"] = k_tokens
        batch["k_mask"] = k_mask

        return batch


# --- src/inbatch.py (single process: gather is the identity, rank 0) ---
class InBatch(nn.Module):
    def __init__(self, opt, retriever):
        super(InBatch, self).__init__()
        self.opt = opt
        self.norm_doc = opt.norm_doc
        self.norm_query = opt.norm_query
        self.label_smoothing = opt.label_smoothing
        self.encoder = retriever

    def forward(self, q_tokens, q_mask, k_tokens, k_mask, **kwargs):
        bsz = len(q_tokens)
        labels = torch.arange(0, bsz, dtype=torch.long, device=q_tokens.device)

        qemb = self.encoder(input_ids=q_tokens, attention_mask=q_mask, normalize=self.norm_query)
        kemb = self.encoder(input_ids=k_tokens, attention_mask=k_mask, normalize=self.norm_doc)

        gather_kemb = kemb
        scores = torch.einsum("id, jd->ij", qemb / self.opt.temperature, gather_kemb)
        loss = torch.nn.functional.cross_entropy(scores, labels, label_smoothing=self.label_smoothing)
        return loss, qemb, kemb, scores


def reference_embedding(encoder, tokens, normalize):
    # one sequence alone, no padding at all: the plain token mean of its hidden states
    ids = tokens[None].long()
    hidden = BertModel.forward(encoder, input_ids=ids, attention_mask=torch.ones_like(ids))["last_hidden_state"][0]
    emb = hidden.mean(dim=0)
    if normalize:
        emb = emb / emb.norm()
    return emb


def main():
    cfg = BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64, pad_token_id=0)
    opt = SimpleNamespace(norm_doc=True, norm_query=True, label_smoothing=0.1, temperature=0.05,
                          pooling="average")
    retriever = Contriever(cfg, pooling=opt.pooling).eval()
    model = InBatch(opt, retriever).eval()

    cls_id, sep_id = 101 % cfg.vocab_size, 102 % cfg.vocab_size
    q_lens, k_lens = [3, 7, 5, 1], [9, 4, 12, 6]
    examples = []
    for ql, kl in zip(q_lens, k_lens):
        q = add_bos_eos(torch.randint(5, cfg.vocab_size, (ql,)), cls_id, sep_id)
        k = add_bos_eos(torch.randint(5, cfg.vocab_size, (kl,)), cls_id, sep_id)
        examples.append({"q_tokens": q, "k_tokens": k})
    batch = Collator(opt)(examples)
    assert batch["q_mask"].dtype == torch.bool and not batch["q_mask"].all()

    with torch.no_grad():
        loss, qemb, kemb, scores = model(**batch)

        ref_q = torch.stack([reference_embedding(retriever, ex["q_tokens"], opt.norm_query) for ex in examples])
        ref_k = torch.stack([reference_embedding(retriever, ex["k_tokens"], opt.norm_doc) for ex in examples])
        ref_scores = ref_q @ ref_k.T / opt.temperature
        ref_loss = torch.nn.functional.cross_entropy(ref_scores, torch.arange(len(examples)),
                                                     label_smoothing=opt.label_smoothing)

        # the raw average (no normalisation), where the divisor by the real lengths shows
        raw_k = retriever(input_ids=batch["k_tokens"], attention_mask=batch["k_mask"], normalize=False)
        ref_raw_k = torch.stack([reference_embedding(retriever, ex["k_tokens"], False) for ex in examples])

    assert torch.allclose(qemb, ref_q, atol=1e-5), (qemb - ref_q).abs().max()
    assert torch.allclose(kemb, ref_k, atol=1e-5), (kemb - ref_k).abs().max()
    assert torch.allclose(raw_k, ref_raw_k, atol=1e-5), (raw_k - ref_raw_k).abs().max()
    assert torch.allclose(scores, ref_scores, atol=1e-3), (scores - ref_scores).abs().max()
    assert torch.allclose(loss, ref_loss, atol=1e-5), (loss.item(), ref_loss.item())
    print(f"InBatch loss {loss.item():.6f} == per-sequence unpadded reference {ref_loss.item():.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
