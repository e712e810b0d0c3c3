# Correct program (quiet batch quiet-r117a).
# Ported from modelscope/ms-swift @3602360a562313afbf2ef6065fdf61f271a2c5b9:
#   swift/template/base.py (Template.packing_row; Template._data_collator, its padding_free branch: the batch is
#     packed into one row, position_ids restart at 0 for each sample, no attention_mask is returned, labels
#     padded with -100),
#   swift/utils/transformers_utils.py (get_cu_seqlens_from_position_ids).
# `--padding_free true` (or `--packing true`) needs a varlen kernel: the packed row is handed to the model with its
# position_ids and no attention_mask, and the flash path recovers each sample's bounds from where the positions
# restart at 0. Here a tiny LlamaForCausalLM (LlamaConfig, float64) runs the packed row two ways:
#   * "swift_varlen": an attention function registered with transformers' AttentionInterface, a CPU stand-in for
#     flash_attn_varlen_func: cu_seqlens from ms-swift's get_cu_seqlens_from_position_ids, one causal SDPA per
#     sample (its mask interface is transformers' flash_attention_2 one);
#   * "sdpa": transformers builds the block-causal mask itself from the packed position_ids (it does so when no
#     attention_mask and no cache are given, as in a training step: the config has use_cache=False).
# Self-check: every sample alone (no padding, no mask) gives the same logits on each of its tokens, and the packed
# row's loss equals the token-weighted mean of the solo losses. Each sample starts with prompt tokens labelled
# -100, so the shifted labels never ask a sample's last token to predict the next sample's first token.
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)

PAD_TOKEN_ID = 0


# --- swift/utils/transformers_utils.py ---
def get_cu_seqlens_from_position_ids(position_ids: torch.LongTensor):
    position_ids = position_ids[0]
    seq_start_indices = torch.where(position_ids == 0)[0]
    seq_end_indices = torch.cat([seq_start_indices[1:], torch.tensor([len(position_ids)], device=position_ids.device)])
    seq_lengths = seq_end_indices - seq_start_indices
    cu_seqlens = torch.cumsum(torch.cat([torch.tensor([0], device=position_ids.device), seq_lengths]), dim=0)
    return cu_seqlens.to(torch.int32)


# --- swift/template/base.py (trimmed to the text-only padding_free path) ---
class Template:

    def __init__(self, pad_token_id, padding_free=False, padding_side='right'):
        self.pad_token_id = pad_token_id
        self.padding_free = padding_free  # padding_free/packing
        self.padding_side = padding_side

    def encode(self, prompt_ids, response_ids):
        input_ids = list(prompt_ids) + list(response_ids)
        labels = [-100] * len(prompt_ids) + list(response_ids)
        return {'input_ids': input_ids, 'labels': labels, 'length': len(input_ids)}

    def packing_row(self, row):
        packed = {}
        keys = set()
        length = []
        for r in row:
            keys.update(r.keys())
            length.append(r['length'])
        for key in keys:
            if key in {'input_ids', 'labels', 'loss_scale', 'position_ids', 'token_type_ids'}:
                packed[key] = sum((x.get(key) or [] for x in row), start=[])
        if 'position_ids' not in packed:
            packed['position_ids'] = sum((list(range(x)) for x in length), start=[])
        return packed

    @staticmethod
    def _pad_sequence(sequences, padding_value, padding_side):
        padding_right = padding_side == 'right'
        max_len = max(seq.shape[0] for seq in sequences)
        padded = []
        for seq in sequences:
            pad_len = max_len - seq.shape[0]
            pad = (0, pad_len) if padding_right else (pad_len, 0)
            padded.append(F.pad(seq, pad, 'constant', padding_value))
        return torch.stack(padded)

    def _data_collator(self, batch):
        padding_side = self.padding_side
        if self.padding_free:
            batch[:] = [self.packing_row(batch)]
            assert 'position_ids' in batch[0], f'batch[0]: {batch[0]}'

        res = {}
        gather_keys = ['labels', 'loss_scale', 'position_ids', 'token_type_ids']
        if self.padding_free:
            assert len(batch) == 1, f'batch: {batch}'
            for k in ['input_ids'] + gather_keys:
                v = batch[0].get(k)
                if v is not None:
                    res[k] = [v]
        else:
            res['input_ids'] = [b['input_ids'] for b in batch]
            for key in gather_keys:
                val = [b[key] for b in batch if b.get(key) is not None]
                if val:
                    res[key] = val

        pad_keys = ['input_ids', 'attention_mask'] + gather_keys
        pad_values = [self.pad_token_id, 0] + [-100, 0., 0, 0]
        seq_lens = None
        for key in pad_keys:
            if key not in res:
                continue
            for i, val in enumerate(res[key]):
                if isinstance(val, (list, tuple)):
                    val = torch.tensor(val)
                res[key][i] = val
            if not seq_lens:
                seq_lens = [seq.shape[0] for seq in res[key]]
        if not self.padding_free and seq_lens and 'input_ids' in res:
            res['attention_mask'] = [torch.ones(seq_len, dtype=torch.int64) for seq_len in seq_lens]

        for key, pad_value in zip(pad_keys, pad_values):
            if key not in res:
                continue
            res[key] = self._pad_sequence(res[key], pad_value, padding_side)
        return res


# --- a CPU stand-in for flash_attn_varlen_func, reached the way the flash path is: from position_ids ---
def swift_varlen_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                   position_ids=None, **kwargs):
    # query/key/value: (1, heads, total_tokens, head_dim), one packed row
    assert query.shape[0] == 1 and attention_mask is None
    cu_seqlens = get_cu_seqlens_from_position_ids(position_ids)
    n_rep = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(n_rep, dim=1)
    value = value.repeat_interleave(n_rep, dim=1)
    outs = []
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        outs.append(
            F.scaled_dot_product_attention(
                query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
                dropout_p=dropout, is_causal=True, scale=scaling))
    attn_output = torch.cat(outs, dim=2).transpose(1, 2).contiguous()
    return attn_output, None


AttentionInterface.register('swift_varlen', swift_varlen_attention_forward)
AttentionMaskInterface.register('swift_varlen', ALL_MASK_ATTENTION_FUNCTIONS['flash_attention_2'])


def build_model(attn_implementation):
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=PAD_TOKEN_ID,
        attn_implementation=attn_implementation,
        use_cache=False,  # a training step: no KV cache
    )
    torch.manual_seed(1)
    return LlamaForCausalLM(config).eval()


def main():
    g = torch.Generator().manual_seed(2)
    # (prompt, response) lengths of four samples
    shapes = [(3, 2), (5, 6), (2, 2), (4, 5)]
    samples = [(torch.randint(1, 97, (p, ), generator=g).tolist(), torch.randint(1, 97, (r, ), generator=g).tolist())
               for p, r in shapes]

    template = Template(PAD_TOKEN_ID, padding_free=True)
    encoded = [template.encode(p, r) for p, r in samples]
    lengths = [e['length'] for e in encoded]
    batch = template._data_collator([dict(e) for e in encoded])
    assert 'attention_mask' not in batch
    assert batch['input_ids'].shape == (1, sum(lengths))
    cu_seqlens = get_cu_seqlens_from_position_ids(batch['position_ids'])
    assert cu_seqlens.tolist() == [0] + torch.tensor(lengths).cumsum(0).tolist()

    ref_model = build_model('sdpa')
    solo_logits, solo_loss_sum, solo_tokens = [], 0.0, 0
    with torch.no_grad():
        for e in encoded:
            ids = torch.tensor([e['input_ids']])
            labels = torch.tensor([e['labels']])
            out = ref_model(input_ids=ids, labels=labels)
            n = int((labels[:, 1:] != -100).sum())
            solo_logits.append(out.logits[0])
            solo_loss_sum += out.loss.item() * n
            solo_tokens += n
    solo_loss = solo_loss_sum / solo_tokens

    for attn_implementation in ['swift_varlen', 'sdpa']:
        model = build_model(attn_implementation)
        with torch.no_grad():
            out = model(**batch)
        for i, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
            err = (out.logits[0, start:end] - solo_logits[i]).abs().max().item()
            assert err < 1e-10, (attn_implementation, i, err)
        loss_err = abs(out.loss.item() - solo_loss)
        assert loss_err < 1e-5, (attn_implementation, loss_err)  # transformers' loss upcasts to float32
        print(f'{attn_implementation}: packed row of {lengths} matches each sample alone '
              f'(loss {out.loss.item():.6f}, err {loss_err:.1e})')

    # the same samples right-padded, the non-padding-free collator: same per-token logits
    padded = Template(PAD_TOKEN_ID, padding_free=False)._data_collator([dict(e) for e in encoded])
    with torch.no_grad():
        out = ref_model(input_ids=padded['input_ids'], attention_mask=padded['attention_mask'],
                        labels=padded['labels'])
    for i, n in enumerate(lengths):
        err = (out.logits[i, :n] - solo_logits[i]).abs().max().item()
        assert err < 1e-10, ('padded', i, err)
    assert abs(out.loss.item() - solo_loss) < 1e-5
    print('right-padded batch matches too')


if __name__ == '__main__':
    main()
