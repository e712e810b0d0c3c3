"""Trankit's tagger/parser input path, shrunk: a right-padded batch of word-piece
ids goes through XLM-RoBERTa with a 0/1 float attention mask, word-piece
vectors are averaged back into words with a gather + 1/len weights (pad slots
point at <s> with weight 0), and the biaffine head scorer masks the diagonal
and padded head columns before a cross-entropy with ignore_index -100.

Ported from nlp-uoregon/trankit @04a9ef1ee4a2b653c6d8ed93aea46e18ee13c824:
  trankit/iterators/tagger_iterators.py  (collate_fn: piece_idxs padded with 0,
      attention_masks padded with 0, word_mask = [0]*(n+1) + [1]*pad as bool,
      upos/xpos targets padded with -100, head/deprel ids padded with 0)
  trankit/utils/base_utils.py            (word_lens_to_idxs_fast)
  trankit/models/base_models.py          (Base_Model.encode_words, Deep_Biaffine)
  trankit/models/classifiers.py          (PosDepClassifier.forward)
The adapter-equipped XLM-R is replaced by a tiny transformers XLMRobertaModel
built from XLMRobertaConfig (random weights, nothing downloaded); both the
eager and SDPA attention paths are run.

Checks: word representations, cls vectors and per-sentence losses of the
padded batch equal each sentence run alone (no padding), and the gathered
word vectors equal an explicit loop averaging each word's pieces.
"""
import torch
import torch.nn as nn
from transformers import XLMRobertaConfig, XLMRobertaModel

torch.manual_seed(0)


def word_lens_to_idxs_fast(token_lens):
    max_token_num = max([len(x) for x in token_lens])
    max_token_len = max([max(x) for x in token_lens])
    idxs, masks = [], []
    for seq_token_lens in token_lens:
        seq_idxs, seq_masks = [], []
        offset = 0
        for token_len in seq_token_lens:
            seq_idxs.extend([i + offset for i in range(token_len)]
                            + [-1] * (max_token_len - token_len))
            seq_masks.extend([1.0 / token_len] * token_len
                             + [0.0] * (max_token_len - token_len))
            offset += token_len
        seq_idxs.extend([-1] * max_token_len * (max_token_num - len(seq_token_lens)))
        seq_masks.extend([0.0] * max_token_len * (max_token_num - len(seq_token_lens)))
        idxs.append(seq_idxs)
        masks.append(seq_masks)
    return idxs, masks, max_token_num, max_token_len


class Deep_Biaffine(nn.Module):
    def __init__(self, in_dim1, in_dim2, hidden_dim, output_dim):
        super().__init__()
        self.in_dim1 = in_dim1
        self.in_dim2 = in_dim2
        self.hidden_dim = hidden_dim
        self.output_dim = output_dim
        self.ffn1 = nn.Sequential(nn.Linear(in_dim1, hidden_dim), nn.ReLU(), nn.Dropout(0.5))
        self.ffn2 = nn.Sequential(nn.Linear(in_dim2, hidden_dim), nn.ReLU(), nn.Dropout(0.5))
        # trankit zero-inits this and trains it; random here so the scores are not flat
        self.pairwise_weight = nn.Parameter(torch.randn(in_dim1 + 1, in_dim2 + 1, output_dim) * 0.3)

    def forward(self, x1, x2):
        h1 = self.ffn1(x1)
        h2 = self.ffn2(x2)
        g1 = torch.cat([h1, h1.new_ones(*h1.size()[:-1], 1)], len(h1.size()) - 1)
        g2 = torch.cat([h2, h2.new_ones(*h2.size()[:-1], 1)], len(h2.size()) - 1)
        g1_size = g1.size()
        g2_size = g2.size()
        g1_w = torch.mm(g1.view(-1, g1_size[-1]), self.pairwise_weight.view(-1, (self.in_dim2 + 1) * self.output_dim))
        g2 = g2.transpose(1, 2)
        g1_w_g2 = g1_w.view(g1_size[0], g1_size[1] * self.output_dim, g2_size[2]).bmm(g2)
        g1_w_g2 = g1_w_g2.view(g1_size[0], g1_size[1], self.output_dim, g2_size[1]).transpose(2, 3)
        return g1_w_g2


class Batch:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def collate_fn(batch):
    """tagger_iterators.TaggerDataset.collate_fn, the fields used here."""
    max_word_num = max(inst["word_num"] for inst in batch)
    max_wordpiece_num = max(len(inst["piece_idxs"]) for inst in batch)
    piece_idxs, attention_masks, word_lens = [], [], []
    upos, xpos, upos_ids, head_ids, deprel_ids, word_mask = [], [], [], [], [], []
    for inst in batch:
        pad_w = max_word_num - inst["word_num"]
        piece_idxs.append(inst["piece_idxs"] + [0] * (max_wordpiece_num - len(inst["piece_idxs"])))
        attention_masks.append(inst["attention_masks"] + [0] * (max_wordpiece_num - len(inst["piece_idxs"])))
        word_lens.append(inst["word_lens"])
        upos.extend(inst["upos"] + [-100] * pad_w)
        xpos.extend(inst["xpos"] + [-100] * pad_w)
        upos_ids.append(inst["upos"] + [0] * pad_w)
        head_ids.append(inst["head"] + [0] * pad_w)
        deprel_ids.append(inst["deprel"] + [0] * pad_w)
        word_mask.append([0] * (inst["word_num"] + 1) + [1] * pad_w)
    return Batch(
        word_num=[inst["word_num"] for inst in batch],
        piece_idxs=torch.tensor(piece_idxs, dtype=torch.long),
        attention_masks=torch.tensor(attention_masks, dtype=torch.float),
        word_lens=word_lens,
        upos_type_idxs=torch.tensor(upos, dtype=torch.long),
        xpos_type_idxs=torch.tensor(xpos, dtype=torch.long),
        upos_ids=torch.tensor(upos_ids, dtype=torch.long),
        head_idxs=torch.tensor(head_ids, dtype=torch.long),
        deprel_idxs=torch.tensor(deprel_ids, dtype=torch.long),
        word_mask=torch.tensor(word_mask, dtype=torch.bool),  # True = padding
    )


class TinyTrankitTagger(nn.Module):
    def __init__(self, attn_impl, n_upos=5, n_xpos=6, n_deprel=4):
        super().__init__()
        cfg = XLMRobertaConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=32, max_position_embeddings=48, pad_token_id=1,
                               bos_token_id=0, eos_token_id=2, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0)
        cfg._attn_implementation = attn_impl
        self.xlmr = XLMRobertaModel(cfg, add_pooling_layer=False)
        self.xlmr_dim = 16
        self.n_upos, self.n_xpos, self.n_deprel = n_upos, n_xpos, n_deprel
        self.upos_embedding = nn.Embedding(n_upos, 4)
        self.upos_ffn = nn.Linear(self.xlmr_dim, n_upos)
        self.xpos_ffn = nn.Linear(self.xlmr_dim + 4, n_xpos)
        self.down_dim = self.xlmr_dim // 2
        self.down_project = nn.Linear(self.xlmr_dim, self.down_dim)
        self.unlabeled = Deep_Biaffine(self.down_dim, self.down_dim, self.down_dim, 1)
        self.deprel = Deep_Biaffine(self.down_dim, self.down_dim, self.down_dim, n_deprel)
        self.criteria = nn.CrossEntropyLoss()

    def encode_words(self, piece_idxs, attention_masks, word_lens):
        batch_size, _ = piece_idxs.size()
        all_xlmr_outputs = self.xlmr(piece_idxs, attention_mask=attention_masks)
        xlmr_outputs = all_xlmr_outputs[0]
        cls_reprs = xlmr_outputs[:, 0, :].unsqueeze(1)  # [batch size, 1, xlmr dim]
        # average all pieces for multi-piece words
        idxs, masks, token_num, token_len = word_lens_to_idxs_fast(word_lens)
        idxs = piece_idxs.new(idxs).unsqueeze(-1).expand(batch_size, -1, self.xlmr_dim) + 1
        masks = xlmr_outputs.new(masks).unsqueeze(-1)
        xlmr_outputs = torch.gather(xlmr_outputs, 1, idxs) * masks
        xlmr_outputs = xlmr_outputs.view(batch_size, token_num, token_len, self.xlmr_dim)
        xlmr_outputs = xlmr_outputs.sum(2)
        return xlmr_outputs, cls_reprs

    def forward(self, batch):
        word_reprs, cls_reprs = self.encode_words(batch.piece_idxs, batch.attention_masks, batch.word_lens)
        upos_scores = self.upos_ffn(word_reprs).view(-1, self.n_upos)
        xpos_reprs = torch.cat([word_reprs, self.upos_embedding(batch.upos_ids)], dim=2)
        xpos_scores = self.xpos_ffn(xpos_reprs).view(-1, self.n_xpos)
        loss = self.criteria(upos_scores, batch.upos_type_idxs) + \
            self.criteria(xpos_scores, batch.xpos_type_idxs)

        # head: cls serves as ROOT node
        dep_reprs = torch.cat([cls_reprs, word_reprs], dim=1)
        dep_reprs = self.down_project(dep_reprs)
        unlabeled_scores = self.unlabeled(dep_reprs, dep_reprs).squeeze(3)
        diag = torch.eye(batch.head_idxs.size(-1) + 1, dtype=torch.bool).unsqueeze(0)
        unlabeled_scores.masked_fill_(diag, -float("inf"))
        unlabeled_scores = unlabeled_scores[:, 1:, :]
        unlabeled_scores = unlabeled_scores.masked_fill(batch.word_mask.unsqueeze(1), -float("inf"))
        unlabeled_target = batch.head_idxs.masked_fill(batch.word_mask[:, 1:], -100)
        loss += self.criteria(unlabeled_scores.contiguous().view(-1, unlabeled_scores.size(2)),
                              unlabeled_target.view(-1))
        # deprel
        deprel_scores = self.deprel(dep_reprs, dep_reprs)
        deprel_scores = deprel_scores[:, 1:]
        deprel_scores = torch.gather(deprel_scores, 2, batch.head_idxs.unsqueeze(2).unsqueeze(3).expand(
            -1, -1, -1, self.n_deprel)).view(-1, self.n_deprel)
        deprel_target = batch.deprel_idxs.masked_fill(batch.word_mask[:, 1:], -100)
        loss += self.criteria(deprel_scores.contiguous(), deprel_target.view(-1))
        return loss, word_reprs, cls_reprs, unlabeled_scores


def make_instance(word_lens, gen):
    n_pieces = sum(word_lens)
    pieces = torch.randint(3, 40, (n_pieces,), generator=gen).tolist()
    piece_idxs = [0] + pieces + [2]  # <s> ... </s>
    n = len(word_lens)
    heads = [int(torch.randint(0, n + 1, (1,), generator=gen)) for _ in range(n)]
    heads = [h if h != i + 1 else 0 for i, h in enumerate(heads)]  # no self-loops
    return {
        "word_num": n,
        "piece_idxs": piece_idxs,
        "attention_masks": [1] * len(piece_idxs),
        "word_lens": word_lens,
        "upos": torch.randint(0, 5, (n,), generator=gen).tolist(),
        "xpos": torch.randint(0, 6, (n,), generator=gen).tolist(),
        "head": heads,
        "deprel": torch.randint(0, 4, (n,), generator=gen).tolist(),
    }


def main():
    gen = torch.Generator().manual_seed(1)
    insts = [make_instance(wl, gen) for wl in ([2, 1, 3, 1, 2], [1, 1], [3, 2, 1], [1])]
    ok = True
    for impl in ("eager", "sdpa"):
        torch.manual_seed(0)
        model = TinyTrankitTagger(impl).eval()
        with torch.no_grad():
            batch = collate_fn(insts)
            loss_b, words_b, cls_b, scores_b = model(batch)
            total_words = sum(inst["word_num"] for inst in insts)
            loss_sum = 0.0
            impl_ok = True
            for i, inst in enumerate(insts):
                one = collate_fn([inst])
                loss_1, words_1, cls_1, scores_1 = model(one)
                n = inst["word_num"]
                # every loss term is a mean over the n words of this sentence
                loss_sum += loss_1.item() * n
                impl_ok &= (words_b[i, :n] - words_1[0]).abs().max().item() < 1e-5
                impl_ok &= (cls_b[i] - cls_1[0]).abs().max().item() < 1e-5
                real = scores_1[0].isfinite()
                impl_ok &= bool(torch.equal(scores_b[i, :n, : n + 1].isfinite(), real))
                impl_ok &= (scores_b[i, :n, : n + 1][real] - scores_1[0][real]).abs().max().item() < 1e-4

                # explicit average of each word's pieces (offset 1 for <s>)
                hidden = model.xlmr(one.piece_idxs, attention_mask=one.attention_masks)[0][0]
                start = 1
                for w, wl in enumerate(inst["word_lens"]):
                    ref = hidden[start:start + wl].mean(0)
                    impl_ok &= (words_b[i, w] - ref).abs().max().item() < 1e-5
                    start += wl
            loss_ok = abs(loss_b.item() - loss_sum / total_words) < 1e-4
            print(f"[{impl}] word reprs / cls / head scores padded vs alone: {'match' if impl_ok else 'MISMATCH'}")
            print(f"[{impl}] masked losses batch vs alone: {'match' if loss_ok else 'MISMATCH'}")
            ok &= impl_ok and loss_ok
    print("ALL MATCH" if ok else "MISMATCH")
    assert ok


if __name__ == "__main__":
    main()
