# Correct program (quiet batch quiet-r152a).
# Citation: sb-ai-lab/RePlay @b4e051e8988c71397c3827d1064b0dd88dd3eb64
#   replay/nn/mask.py (AttentionMaskBase.forward, DefaultAttentionMask),
#   replay/nn/sequential/sasrec/model.py (SasRecBody.forward, SasRec.forward_train / forward_inference / get_logits),
#   replay/nn/sequential/sasrec/transformer.py (SasRecTransformerLayer), replay/nn/sequential/sasrec/agg.py
#   (PositionAwareAggregator), replay/nn/agg.py (SumAggregator), replay/nn/embedding.py (CategoricalEmbedding,
#   SequenceEmbedding, item feature only), replay/nn/ffn.py (PointWiseFeedForward), replay/nn/head.py
#   (EmbeddingTyingHead), replay/nn/loss/ce.py (CE), replay/nn/transform/next_token.py (NextTokenTransform),
#   replay/data/nn/parquet/impl/indexing.py (raw_get_mask: LEFT-padded rows and their padding mask).
# User histories are left-padded to the batch length; pad slots hold the item id `padding_value` (= cardinality,
# the embedding's padding_idx, as RePlay's schema sets it). DefaultAttentionMask builds tril & (key is real | key
# is the query itself) as a float (B * heads, L, L) mask (-inf in training, finfo.min in eval), and the encoder
# also hands nn.MultiheadAttention a float key_padding_mask. Positions are right-aligned (pe.weight[-L:]), and
# inference scores the last position, which is every user's most recent real item.
# Training: NextTokenTransform shifts labels by one; the target mask used here is the labels' mask AND the inputs'
# padding mask (RePlay's template passes positive_labels_mask alone, which also scores the pad slot just before
# each left-padded user's first item), so the loss covers real queries only.
# The check: eval logits at the last position and the training CE loss (dropout 0) equal a reference that runs each
# user's history alone, unpadded, through the same weights; pad rows stay finite in eval.
import contextlib
from typing import Optional

import torch

torch.manual_seed(0)

TensorMap = dict


def raw_get_mask(indices, offsets, length):
    length = torch.asarray(length, dtype=torch.int64, device=indices.device)
    last = offsets[indices + 1]
    first = offsets[indices + 0]
    per_line = length - (last - first)
    arange = torch.arange(length, dtype=torch.int64, device=offsets.device)
    raw_indices = (first[:, None] - per_line[:, None]) + arange[None, :]
    mask = (first[:, None] <= raw_indices) & (raw_indices < last[:, None])
    output_indices = torch.where(mask, raw_indices, 0)
    return (mask, output_indices)


def collate(items, offsets, indices, length, padding_value, item_name="item_id"):
    mask, output_indices = raw_get_mask(indices, offsets, length)
    values = torch.where(mask, items[output_indices], padding_value)
    return {item_name: values, f"{item_name}_mask": mask}


class NextTokenTransform(torch.nn.Module):
    def __init__(self, label_name, shift=1, out_feature_name="positive_labels"):
        super().__init__()
        self.label_name = label_name
        self.shift = shift
        self.out_feature_name = out_feature_name

    def forward(self, batch):
        target = {}
        for feature_name in batch:
            target[feature_name] = batch[feature_name][:, : -self.shift, ...].clone()
        target[self.out_feature_name] = batch[self.label_name][:, self.shift :, ...].clone()
        target[f"{self.out_feature_name}_mask"] = batch[f"{self.label_name}_mask"][:, self.shift :, ...].clone()
        return target


class CategoricalEmbedding(torch.nn.Module):
    def __init__(self, cardinality, embedding_dim, padding_value):
        super().__init__()
        self.emb = torch.nn.Embedding(cardinality + 1, embedding_dim, padding_idx=padding_value)

    @property
    def weight(self):
        mask_without_padding = torch.ones(size=(self.emb.weight.size(0),), dtype=torch.bool, device=self.emb.weight.device)
        mask_without_padding[self.emb.padding_idx].zero_()
        return self.emb.weight[mask_without_padding]

    def reset_parameters(self):
        torch.nn.init.xavier_normal_(self.emb.weight)
        self.emb._fill_padding_idx_with_zero()

    def forward(self, indices):
        return self.emb(indices)

    @property
    def embedding_dim(self):
        return self.emb.embedding_dim


class SequenceEmbedding(torch.nn.Module):
    def __init__(self, item_feature_name, cardinality, embedding_dim, padding_value):
        super().__init__()
        self.feature_embedders = torch.nn.ModuleDict(
            {item_feature_name: CategoricalEmbedding(cardinality, embedding_dim, padding_value)}
        )
        self.feature_names = [item_feature_name]
        self._item_feature_name = item_feature_name

    def reset_parameters(self):
        for feature_embedder in self.feature_embedders.values():
            feature_embedder.reset_parameters()

    def forward(self, feature_tensor, feature_names=None):
        return {
            feature_name: self.feature_embedders[feature_name](feature_tensor[feature_name])
            for feature_name in (feature_names or self.feature_names)
        }

    def get_item_weights(self, indices=None):
        if indices is None:
            return self.feature_embedders[self._item_feature_name].weight
        return self.feature_embedders[self._item_feature_name](indices)


class SumAggregator(torch.nn.Module):
    def __init__(self, embedding_dim):
        super().__init__()
        self._embedding_dim = embedding_dim

    @property
    def embedding_dim(self):
        return self._embedding_dim

    def reset_parameters(self):
        pass

    def forward(self, feature_tensors):
        out = sum(feature_tensors.values())
        assert out.size(-1) == self.embedding_dim
        return out


class PositionAwareAggregator(torch.nn.Module):
    def __init__(self, embedding_aggregator, max_sequence_length, dropout):
        super().__init__()
        self.embedding_aggregator = embedding_aggregator
        self.pe = torch.nn.Embedding(max_sequence_length, self.embedding_aggregator.embedding_dim)
        self.dropout = torch.nn.Dropout(p=dropout)

    def reset_parameters(self):
        self.embedding_aggregator.reset_parameters()
        for _, param in self.pe.named_parameters():
            with contextlib.suppress(ValueError):
                torch.nn.init.xavier_normal_(param.data)

    def forward(self, feature_tensors):
        seqs = self.embedding_aggregator(feature_tensors)
        assert seqs.dim() == 3
        batch_size, seq_len, embedding_dim = seqs.size()
        assert seq_len <= self.pe.num_embeddings
        seqs *= embedding_dim**0.5
        seqs += self.pe.weight[-seq_len:].unsqueeze(0).repeat(batch_size, 1, 1)
        seqs = self.dropout(seqs)
        return seqs


class AttentionMaskBase(torch.nn.Module):
    def __init__(self, num_heads):
        super().__init__()
        self.num_heads = num_heads

    def forward(self, feature_tensor, padding_mask):
        attention_mask = self._get_attention_mask(feature_tensor)

        diagonal_attention_mask = torch.diag(
            torch.ones(padding_mask.size(1), dtype=torch.bool, device=padding_mask.device)
        )
        # (B, L) -> (B, 1, 1, L)
        key_padding_mask = padding_mask.unsqueeze(1).unsqueeze(1)
        # (B, 1, 1, L) -> (B, 1, L, L), where 0 - PAD, 1 - otherwise
        key_padding_mask = key_padding_mask | diagonal_attention_mask

        attention_mask = attention_mask & key_padding_mask
        min_value = -torch.inf if self.training else torch.finfo(torch.float32).min
        attention_mask = torch.zeros_like(attention_mask, dtype=torch.float32).masked_fill_(
            attention_mask.logical_not(), min_value
        )

        if attention_mask.size(1) != self.num_heads and attention_mask.shape[1] == 1:
            # (B, 1, L, L) -> (B, num_heads, L, L)
            attention_mask = attention_mask.repeat(1, self.num_heads, 1, 1)
        # (B, num_heads, L, L) -> (B * num_heads, L, L)
        attention_mask = attention_mask.reshape(-1, *attention_mask.shape[-2:])
        return attention_mask

    def _get_attention_mask(self, feature_tensor):
        raise NotImplementedError()


class DefaultAttentionMask(AttentionMaskBase):
    def __init__(self, reference_feature_name, num_heads):
        super().__init__(num_heads)
        self._feature_name = reference_feature_name

    def _get_attention_mask(self, feature_tensor):
        input_sequence = feature_tensor[self._feature_name]
        return torch.tril(
            torch.ones(
                (input_sequence.size(1), input_sequence.size(1)),
                dtype=torch.bool,
                device=input_sequence.device,
            )
        )


class PointWiseFeedForward(torch.nn.Module):
    def __init__(self, embedding_dim, dropout, activation="gelu"):
        super().__init__()
        self.conv1 = torch.nn.Conv1d(embedding_dim, embedding_dim, kernel_size=1)
        self.dropout1 = torch.nn.Dropout(p=dropout)
        self.activation = torch.nn.ReLU() if activation == "relu" else torch.nn.GELU()
        self.conv2 = torch.nn.Conv1d(embedding_dim, embedding_dim, kernel_size=1)
        self.dropout2 = torch.nn.Dropout(p=dropout)

    def reset_parameters(self):
        for _, param in self.named_parameters():
            with contextlib.suppress(ValueError):
                torch.nn.init.xavier_normal_(param.data)

    def forward(self, input_embeddings):
        x = self.conv1(input_embeddings.transpose(-1, -2))
        x = self.activation(x)
        x = self.dropout1(x)
        x = self.conv2(x)
        x = self.dropout2(x)
        x = x.transpose(-1, -2)
        x += input_embeddings
        return x


class SasRecTransformerLayer(torch.nn.Module):
    def __init__(self, embedding_dim, num_heads, num_blocks, dropout, activation="gelu"):
        super().__init__()
        self.num_blocks = num_blocks
        self.attention_layers = torch.nn.ModuleList(
            [
                torch.nn.MultiheadAttention(
                    embed_dim=embedding_dim,
                    num_heads=num_heads,
                    dropout=dropout,
                    batch_first=True,
                )
                for _ in range(num_blocks)
            ]
        )
        self.attention_layernorms = torch.nn.ModuleList(
            [torch.nn.LayerNorm(embedding_dim, eps=1e-8) for _ in range(num_blocks)]
        )
        self.forward_layers = torch.nn.ModuleList(
            [PointWiseFeedForward(embedding_dim=embedding_dim, dropout=dropout, activation=activation) for _ in range(num_blocks)]
        )
        self.forward_layernorms = torch.nn.ModuleList(
            [torch.nn.LayerNorm(embedding_dim, eps=1e-8) for _ in range(num_blocks)]
        )

    def reset_parameters(self):
        for i in range(self.num_blocks):
            self.attention_layernorms[i].reset_parameters()
            self.forward_layernorms[i].reset_parameters()
            self.forward_layers[i].reset_parameters()
        for _, param in self.attention_layers.named_parameters():
            with contextlib.suppress(ValueError):
                torch.nn.init.xavier_normal_(param.data)

    def forward(self, feature_tensors, input_embeddings, padding_mask, attention_mask):
        seqs = input_embeddings
        key_padding_mask = torch.zeros_like(padding_mask, dtype=torch.float32).masked_fill_(
            padding_mask.logical_not(), -torch.inf if self.training else torch.finfo(torch.float32).min
        )
        for i in range(self.num_blocks):
            query = self.attention_layernorms[i](seqs)
            attn_emb, _ = self.attention_layers[i](
                query,
                seqs,
                seqs,
                attn_mask=attention_mask,
                key_padding_mask=key_padding_mask,
                need_weights=False,
            )
            seqs = query + attn_emb
            seqs = self.forward_layernorms[i](seqs)
            seqs = self.forward_layers[i](seqs)
        return seqs


class EmbeddingTyingHead(torch.nn.Module):
    def forward(self, hidden_states, item_embeddings):
        if item_embeddings.dim() == 2:
            item_embeddings = item_embeddings.transpose(-1, -2).contiguous()
            return hidden_states.matmul(item_embeddings)
        item_embeddings = item_embeddings.transpose(-1, -2).contiguous()
        hidden_states = hidden_states.unsqueeze(-2)
        logits = hidden_states.matmul(item_embeddings)
        return logits.squeeze(-2)


class CE(torch.nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self._loss = torch.nn.CrossEntropyLoss(**kwargs)
        self.logits_callback = None

    def forward(self, model_embeddings, feature_tensors, positive_labels, negative_labels, padding_mask, target_padding_mask):
        logits = self.logits_callback(model_embeddings)  # [batch_size, seq_len, vocab_size]
        labels = positive_labels.masked_fill(
            mask=(~target_padding_mask),
            value=self._loss.ignore_index,
        )  # [batch_size, seq_len, 1]
        logits_flat = logits.view(-1, logits.size(-1))
        labels_flat = labels.view(-1)
        return self._loss(logits_flat, labels_flat)


class SasRecBody(torch.nn.Module):
    def __init__(self, embedder, embedding_aggregator, attn_mask_builder, encoder, output_normalization):
        super().__init__()
        self.embedder = embedder
        self.attn_mask_builder = attn_mask_builder
        self.embedding_aggregator = embedding_aggregator
        self.encoder = encoder
        self.output_normalization = output_normalization

    def reset_parameters(self):
        self.embedder.reset_parameters()
        self.embedding_aggregator.reset_parameters()
        self.encoder.reset_parameters()
        self.output_normalization.reset_parameters()

    def forward(self, feature_tensors, padding_mask):
        embeddings = self.embedder(feature_tensors)
        agg_emb = self.embedding_aggregator(embeddings)
        assert agg_emb.dim() == 3

        attn_mask = self.attn_mask_builder(feature_tensors, padding_mask)

        hidden_state = self.encoder(
            feature_tensors=feature_tensors,
            input_embeddings=agg_emb,
            padding_mask=padding_mask,
            attention_mask=attn_mask,
        )
        assert agg_emb.size() == hidden_state.size()

        hidden_state = self.output_normalization(hidden_state)
        return hidden_state


class SasRec(torch.nn.Module):
    def __init__(self, embedder, embedding_aggregator, attn_mask_builder, encoder, output_normalization, loss):
        super().__init__()
        self.body = SasRecBody(
            embedder=embedder,
            embedding_aggregator=embedding_aggregator,
            attn_mask_builder=attn_mask_builder,
            encoder=encoder,
            output_normalization=output_normalization,
        )
        self.head = EmbeddingTyingHead()
        self.loss = loss
        self.loss.logits_callback = self.get_logits
        self.reset_parameters()

    @classmethod
    def build_original(cls, item_feature_name, cardinality, padding_value, embedding_dim=192, head_count=4,
                       block_count=2, max_sequence_length=50, dropout=0.3):
        return cls(
            embedder=SequenceEmbedding(item_feature_name, cardinality, embedding_dim, padding_value),
            embedding_aggregator=PositionAwareAggregator(
                embedding_aggregator=SumAggregator(embedding_dim=embedding_dim),
                max_sequence_length=max_sequence_length,
                dropout=dropout,
            ),
            attn_mask_builder=DefaultAttentionMask(
                reference_feature_name=item_feature_name,
                num_heads=head_count,
            ),
            encoder=SasRecTransformerLayer(
                embedding_dim=embedding_dim,
                num_heads=head_count,
                num_blocks=block_count,
                dropout=dropout,
                activation="relu",
            ),
            output_normalization=torch.nn.LayerNorm(embedding_dim),
            loss=CE(ignore_index=padding_value),
        )

    def reset_parameters(self):
        self.body.reset_parameters()

    def get_logits(self, model_embeddings, candidates_to_score=None):
        item_embeddings = self.body.embedder.get_item_weights(candidates_to_score)
        return self.head(model_embeddings, item_embeddings)

    def forward_train(self, feature_tensors, padding_mask, positive_labels, negative_labels, target_padding_mask):
        hidden_states = self.body(feature_tensors, padding_mask)
        loss = self.loss(
            model_embeddings=hidden_states,
            feature_tensors=feature_tensors,
            positive_labels=positive_labels,
            negative_labels=negative_labels,
            padding_mask=padding_mask,
            target_padding_mask=target_padding_mask,
        )
        return {"loss": loss, "hidden_states": (hidden_states,)}

    def forward_inference(self, feature_tensors, padding_mask, candidates_to_score=None):
        hidden_states = self.body(feature_tensors, padding_mask)
        last_hidden_state = hidden_states[:, -1, :].contiguous()
        logits = self.get_logits(last_hidden_state, candidates_to_score)
        return {"logits": logits, "hidden_states": (hidden_states,)}

    def forward(self, feature_tensors, padding_mask, candidates_to_score=None, positive_labels=None,
                negative_labels=None, target_padding_mask=None):
        if self.training:
            return self.forward_train(feature_tensors, padding_mask, positive_labels, negative_labels, target_padding_mask)
        return self.forward_inference(feature_tensors, padding_mask, candidates_to_score)


def make_batch(histories, length, padding_value):
    items = torch.cat([torch.tensor(h, dtype=torch.long) for h in histories])
    offsets = torch.tensor([0] + [len(h) for h in histories]).cumsum(0)
    indices = torch.arange(len(histories))
    return collate(items, offsets, indices, length, padding_value)


def main():
    NUM_ITEMS = 40
    PADDING_VALUE = NUM_ITEMS
    ITEM = "item_id"
    model = SasRec.build_original(
        item_feature_name=ITEM,
        cardinality=NUM_ITEMS,
        padding_value=PADDING_VALUE,
        embedding_dim=32,
        head_count=4,
        block_count=2,
        max_sequence_length=12,
        dropout=0.0,
    )

    gen = torch.Generator().manual_seed(1)
    lengths = [9, 3, 6, 1, 9, 5]
    histories = [torch.randint(0, NUM_ITEMS, (n,), generator=gen).tolist() for n in lengths]
    max_len = max(lengths)

    # Inference: score all items from the last position of left-padded histories.
    model.eval()
    batch = make_batch(histories, max_len, PADDING_VALUE)
    assert (batch[ITEM] == PADDING_VALUE).sum() == sum(max_len - n for n in lengths)
    with torch.no_grad():
        out = model(feature_tensors={ITEM: batch[ITEM]}, padding_mask=batch[f"{ITEM}_mask"])
        assert torch.isfinite(out["hidden_states"][0]).all()
        max_err = 0.0
        for u, history in enumerate(histories):
            alone = make_batch([history], len(history), PADDING_VALUE)
            assert alone[f"{ITEM}_mask"].all()
            ref = model(feature_tensors={ITEM: alone[ITEM]}, padding_mask=alone[f"{ITEM}_mask"])["logits"][0]
            max_err = max(max_err, (out["logits"][u] - ref).abs().max().item())
        assert max_err < 1e-4, max_err
        top = out["logits"].topk(5, dim=-1).indices
        candidates = torch.tensor([3, 7, 11, 19])
        cand = model(feature_tensors={ITEM: batch[ITEM]}, padding_mask=batch[f"{ITEM}_mask"],
                     candidates_to_score=candidates)["logits"]
        assert torch.allclose(cand, out["logits"][:, candidates], atol=1e-5)
    print(f"inference: last-position logits vs per-user unpadded runs, max abs err {max_err:.2e}")
    print("top-5 items per user:", top.tolist())

    # Training: next-item CE over every real position (dropout 0 so the step is deterministic).
    model.train()
    train_histories = [h + [int(torch.randint(0, NUM_ITEMS, (1,), generator=gen))] for h in histories]
    train_len = max_len + 1
    raw = make_batch(train_histories, train_len, PADDING_VALUE)
    tb = NextTokenTransform(label_name=ITEM, shift=1)(raw)
    # A label counts only where its input slot is a real item too: the pad slot just before a user's first
    # item has a real label but no history to predict it from.
    target_padding_mask = tb["positive_labels_mask"] & tb[f"{ITEM}_mask"]
    out = model(
        feature_tensors={ITEM: tb[ITEM]},
        padding_mask=tb[f"{ITEM}_mask"],
        positive_labels=tb["positive_labels"].unsqueeze(-1),
        target_padding_mask=target_padding_mask.unsqueeze(-1),
    )
    loss = out["loss"]
    real_rows = tb[f"{ITEM}_mask"]
    assert torch.isfinite(out["hidden_states"][0][real_rows]).all()
    assert torch.isfinite(loss)

    ref_sum, ref_count = 0.0, 0
    for history in train_histories:
        alone = NextTokenTransform(label_name=ITEM, shift=1)(make_batch([history], len(history), PADDING_VALUE))
        hidden = model.body({ITEM: alone[ITEM]}, alone[f"{ITEM}_mask"])
        logits = model.get_logits(hidden)[0]
        ref_sum = ref_sum + torch.nn.functional.cross_entropy(logits, alone["positive_labels"][0], reduction="sum")
        ref_count += len(history) - 1
    ref_loss = ref_sum / ref_count
    assert abs(loss.item() - ref_loss.item()) < 1e-5, (loss.item(), ref_loss.item())

    model.zero_grad()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    ref_loss.backward()
    grad_err = max((grads[n] - p.grad).abs().max().item() for n, p in model.named_parameters() if n in grads)
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert grad_err < 1e-5, grad_err
    print(f"training: batched CE {loss.item():.6f} vs per-user {ref_loss.item():.6f}, max grad err {grad_err:.2e}")


if __name__ == "__main__":
    main()
