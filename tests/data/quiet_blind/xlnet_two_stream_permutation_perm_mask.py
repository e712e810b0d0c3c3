"""XLNet permutation language modeling: two-stream attention with perm_mask and target_mapping.

Follows huggingface/transformers src/transformers/data/data_collator.py
(DataCollatorForPermutationLanguageModeling.torch_mask_tokens: span targets, perm_index over a random
factorisation order, `perm_mask[i] = (perm_index.reshape((L, 1)) <= perm_index.reshape((1, L))) &
masked_indices[i]`, one-hot target_mapping) and src/transformers/models/xlnet/modeling_xlnet.py
(XLNetModel.forward: data_mask = input_mask + perm_mask, `attn_mask = (data_mask > 0)`,
`non_tgt_mask = -torch.eye(qlen)` so the content stream always sees itself;
XLNetRelativeAttention.rel_attn_core: `attn_score = attn_score - 1e30 * attn_mask`; post_attention
and the query stream g over target_mapping). Positional terms are kept to the content-content score.
The mask it means (1 = blocked): every token sees every non-target token; a target token k is visible
only to target queries that come after k in the sampled factorisation order (non-targets see no target);
the content stream h additionally always sees itself, the query stream g (target_mapping = eye, the loss
reads only the target rows) does not see its own content. There is no causal triangle: the order is a
random permutation of span pairs, positions stay where they are.
"""
import torch
import torch.nn as nn


def torch_mask_tokens(inputs, plm_probability=1 / 6, max_span_length=3, mask_token_id=5):
    labels = inputs.clone()
    masked_indices = torch.full(labels.shape, 0, dtype=torch.bool)
    target_mapping = torch.zeros((labels.size(0), labels.size(1), labels.size(1)), dtype=torch.float32)
    for i in range(labels.size(0)):
        cur_len, max_len = 0, labels.size(1)
        while cur_len < max_len:
            span_length = torch.randint(1, max_span_length + 1, (1,)).item()
            context_length = int(span_length / plm_probability)
            start_index = cur_len + torch.randint(context_length - span_length + 1, (1,)).item()
            masked_indices[i, start_index:start_index + span_length] = 1
            cur_len += context_length
        target_mapping[i] = torch.eye(labels.size(1))
    non_func_mask = torch.ones_like(labels, dtype=torch.bool)  # no special tokens in this toy batch
    inputs = inputs.masked_fill(masked_indices, mask_token_id)
    labels = labels.masked_fill(~masked_indices, -100)
    perm_mask = torch.zeros((labels.size(0), labels.size(1), labels.size(1)), dtype=torch.float32)
    for i in range(labels.size(0)):
        perm_index = torch.arange(labels.size(1))
        perm_index = perm_index.reshape((-1, labels.size(1) // 2)).transpose(0, 1)
        perm_index = perm_index[torch.randperm(labels.size(1) // 2)]
        perm_index = torch.flatten(perm_index.transpose(0, 1))
        perm_index.masked_fill_(~masked_indices[i] & non_func_mask[i], -1)
        perm_mask[i] = (perm_index.reshape((labels.size(1), 1)) <= perm_index.reshape((1, labels.size(1)))) & masked_indices[i]
    return inputs.long(), perm_mask, target_mapping, labels.long()


class XLNetRelativeAttention(nn.Module):
    def __init__(self, d_model, n_head, d_head):
        super().__init__()
        self.n_head, self.d_head, self.scale = n_head, d_head, 1 / (d_head ** 0.5)
        self.q = nn.Parameter(torch.randn(d_model, n_head, d_head) * 0.02)
        self.k = nn.Parameter(torch.randn(d_model, n_head, d_head) * 0.02)
        self.v = nn.Parameter(torch.randn(d_model, n_head, d_head) * 0.02)
        self.o = nn.Parameter(torch.randn(d_model, n_head, d_head) * 0.02)
        self.r_w_bias = nn.Parameter(torch.zeros(n_head, d_head))
        self.layer_norm = nn.LayerNorm(d_model)

    def rel_attn_core(self, q_head, k_head_h, v_head_h, attn_mask=None):
        ac = torch.einsum("ibnd,jbnd->bnij", q_head + self.r_w_bias, k_head_h)
        attn_score = ac * self.scale
        if attn_mask is not None:
            attn_score = attn_score - 1e30 * torch.einsum("ijbn->bnij", attn_mask)
        attn_prob = nn.functional.softmax(attn_score, dim=3)
        return torch.einsum("bnij,jbnd->ibnd", attn_prob, v_head_h)

    def post_attention(self, h, attn_vec):
        attn_out = torch.einsum("ibnd,hnd->ibh", attn_vec, self.o)
        return self.layer_norm(attn_out + h)

    def forward(self, h, g, attn_mask_h, attn_mask_g, target_mapping):
        k_head_h = torch.einsum("ibh,hnd->ibnd", h, self.k)
        v_head_h = torch.einsum("ibh,hnd->ibnd", h, self.v)
        q_head_h = torch.einsum("ibh,hnd->ibnd", h, self.q)
        output_h = self.post_attention(h, self.rel_attn_core(q_head_h, k_head_h, v_head_h, attn_mask=attn_mask_h))
        q_head_g = torch.einsum("ibh,hnd->ibnd", g, self.q)
        q_head_g = torch.einsum("mbnd,mlb->lbnd", q_head_g, target_mapping)
        attn_vec_g = self.rel_attn_core(q_head_g, k_head_h, v_head_h, attn_mask=attn_mask_g)
        attn_vec_g = torch.einsum("lbnd,mlb->mbnd", attn_vec_g, target_mapping)
        return output_h, self.post_attention(g, attn_vec_g)


class XLNetLMHeadModel(nn.Module):
    def __init__(self, vocab_size=40, d_model=32, n_head=4, n_layer=2):
        super().__init__()
        self.word_embedding = nn.Embedding(vocab_size, d_model)
        self.mask_emb = nn.Parameter(torch.randn(1, 1, d_model) * 0.02)
        self.layer = nn.ModuleList([XLNetRelativeAttention(d_model, n_head, d_model // n_head) for _ in range(n_layer)])
        self.lm_loss = nn.Linear(d_model, vocab_size)

    def forward(self, input_ids, attention_mask, perm_mask, target_mapping, labels=None):
        input_ids = input_ids.transpose(0, 1).contiguous()  # (qlen, bsz)
        qlen, bsz = input_ids.shape
        perm_mask = perm_mask.permute(1, 2, 0).contiguous()  # (qlen, klen, bsz)
        target_mapping = target_mapping.permute(1, 2, 0).contiguous()  # (num_predict, qlen, bsz)
        input_mask = 1.0 - attention_mask.transpose(0, 1).float()
        data_mask = input_mask[None] + perm_mask
        attn_mask = (data_mask[:, :, :, None] > 0).float()
        non_tgt_mask = -torch.eye(qlen)
        non_tgt_mask = ((attn_mask + non_tgt_mask[:, :, None, None]) > 0).float()
        output_h = self.word_embedding(input_ids)
        output_g = self.mask_emb.expand(target_mapping.shape[0], bsz, -1)
        for layer_module in self.layer:
            output_h, output_g = layer_module(output_h, output_g, attn_mask_h=non_tgt_mask, attn_mask_g=attn_mask,
                                              target_mapping=target_mapping)
        logits = self.lm_loss(output_g).permute(1, 0, 2).contiguous()  # (bsz, num_predict, vocab)
        loss = nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)
        return loss, logits


def main():
    torch.manual_seed(0)
    batch = torch.randint(6, 40, (2, 12))
    input_ids, perm_mask, target_mapping, labels = torch_mask_tokens(batch)
    attention_mask = torch.ones_like(input_ids)
    model = XLNetLMHeadModel().eval()
    with torch.no_grad():
        loss, logits = model(input_ids, attention_mask, perm_mask, target_mapping, labels=labels)
    print("targets per row", (labels != -100).sum(1).tolist(), f"plm loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
