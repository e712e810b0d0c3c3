"""Recurrent Memory Transformer (decoder variant) over a right-padded batch, split into segments.

Port, shrunk to tiny sizes, of booydar/recurrent-memory-transformer
@c201626d6aac03131e009b6d6072e0c7752c3aec modeling_rmt/language_modeling.py (MemoryCell,
RecurrentWrapper) around a transformers GPT-2 built from GPT2Config (random weights, no download):

* MemoryCell.process_input puts the memory state on both sides of the segment,
  `[memory ; segment ; memory]` (read tokens first, write tokens last), and `pad_attention_mask`
  builds an all-ones int mask of the new length with the segment's own attention mask copied into
  `[num_mem_tokens : num_mem_tokens + seg_len]`, so both memory blocks are always visible.
* GPT-2 adds its causal mask: the read memory is seen by every token, the write memory (last) sees
  the read memory and every real token of the segment, never a padded one.
* process_output takes the new memory from the last hidden layer's final `num_mem_tokens` rows and
  strips both memory blocks from the logits; RecurrentWrapper.split_tensor cuts input_ids and
  attention_mask the same way (segment_alignment='left'), so a short row's last segments hold only
  padding (its read/write memories still give every query row something to attend to).
* The loss picks positions with `labels_mask` after the usual one-token shift.

Two batches, eager and sdpa attention each:
* right padding, segment_alignment='left': each sequence run alone through the same wrapper,
  unpadded and without any attention mask; logits at every real position and the loss must match.
* left padding, segment_alignment='right' (both supported by split_tensor): a short row's first
  segment is [read mem | pads | real tokens | write mem], padding in the middle of the model input.
  Reference: per row, the same segments with the padded tokens removed from the input (so never
  attended), real tokens and write memory keeping their batch position ids; logits at every real
  position must match, and a run without the mask must not.
"""
import math

import torch
from torch.nn import CrossEntropyLoss
from transformers import GPT2Config, GPT2LMHeadModel

torch.manual_seed(0)


class MemoryCell(torch.nn.Module):
    def __init__(self, base_model, num_mem_tokens):
        super().__init__()
        self.model = base_model
        self.create_memory(num_mem_tokens)

    def create_memory(self, num_mem_tokens):
        self.num_mem_tokens = num_mem_tokens
        embeddings = self.model.get_input_embeddings()
        memory_dim = getattr(self.model.config, 'n_embd', self.model.config.hidden_size)
        memory_weights = torch.randn((num_mem_tokens, memory_dim)) * embeddings.weight.data.std()
        self.register_parameter('memory', torch.nn.Parameter(memory_weights, requires_grad=True))
        self.read_memory_position = range(num_mem_tokens)
        self.write_memory_position = range(-num_mem_tokens, 0)

    def set_memory(self, input_shape):
        return self.memory.repeat(input_shape[0], 1, 1)

    def forward(self, input_ids, memory_state=None, **kwargs):
        if memory_state is None:
            memory_state = self.set_memory(input_ids.shape)
        seg_kwargs = self.process_input(input_ids, memory_state, write_mem=True, **kwargs)
        out = self.model(**seg_kwargs)
        out, new_memory_state = self.process_output(out, **kwargs)
        return out, new_memory_state

    def process_input(self, input_ids, memory_state, write_mem, **kwargs):
        seg_kwargs = dict(**kwargs)
        inputs_embeds = kwargs.get('inputs_embeds')
        if inputs_embeds is None:
            inputs_embeds = self.model.get_input_embeddings()(input_ids)
        if self.num_mem_tokens > 0:
            if write_mem:
                inputs_embeds = torch.cat([memory_state, inputs_embeds, memory_state], dim=1)
            else:
                inputs_embeds = torch.cat([memory_state, inputs_embeds], dim=1)
        seg_kwargs['input_ids'] = None
        seg_kwargs['inputs_embeds'] = inputs_embeds
        if kwargs.get('attention_mask') is not None:
            seg_kwargs['attention_mask'] = self.pad_attention_mask(kwargs['attention_mask'], inputs_embeds.shape)
        seg_kwargs['output_hidden_states'] = True
        return seg_kwargs

    def pad_attention_mask(self, attention_mask, shape):
        if self.num_mem_tokens in {0, None}:
            return attention_mask
        mask = torch.ones(*shape[:2], dtype=torch.int64).to(attention_mask.device)
        mask[:, self.num_mem_tokens: self.num_mem_tokens + attention_mask.shape[1]] = attention_mask
        return mask

    def process_output(self, model_outputs, **kwargs):
        out = {}
        memory_state = model_outputs.hidden_states[-1][:, -self.num_mem_tokens:]
        out['logits'] = model_outputs.logits[:, self.num_mem_tokens:-self.num_mem_tokens]
        out['hidden_states'] = [lh[:, self.num_mem_tokens:-self.num_mem_tokens] for lh in model_outputs.hidden_states]
        return out, memory_state


class RecurrentWrapper(torch.nn.Module):
    def __init__(self, memory_cell, **rmt_kwargs):
        super().__init__()
        self.memory_cell = memory_cell
        self.rmt_config = rmt_kwargs

    def forward(self, input_ids, labels=None, labels_mask=None, attention_mask=None):
        memory_state = None
        segmented = self.segment(input_ids=input_ids, attention_mask=attention_mask)
        cell_outputs = []
        for seg_num, segment in enumerate(segmented):
            cell_out, memory_state = self.memory_cell(**segment, memory_state=memory_state, output_hidden_states=True)
            cell_outputs.append(cell_out)
        return self.process_outputs(cell_outputs, labels=labels, labels_mask=labels_mask)

    def segment(self, **kwargs):
        segments = []
        for k, tensor in kwargs.items():
            if tensor is not None:
                for s, k_seg in enumerate(self.split_tensor(tensor)):
                    if s < len(segments):
                        segments[s][k] = k_seg
                    else:
                        segments.append({k: k_seg})
        return segments

    def split_tensor(self, tensor):
        align = self.rmt_config.get('segment_alignment')
        segment_size = self.rmt_config.get('segment_size')
        if align in {'left', None}:
            split_inds = list(range(0, tensor.shape[1], segment_size)) + [tensor.shape[1]]
            return [tensor[:, start:end] for (start, end) in zip(split_inds, split_inds[1:])]
        elif align == 'right':
            split_inds = (list(range(tensor.shape[1], 0, -segment_size)) + [0])[::-1]
            return [tensor[:, start:end] for (start, end) in zip(split_inds, split_inds[1:])]
        raise NotImplementedError

    def process_outputs(self, cell_outputs, labels=None, labels_mask=None):
        full_logits = torch.cat([o['logits'] for o in cell_outputs], dim=1)
        loss = None
        if labels is not None:
            shift_labels = labels[..., 1:].contiguous()
            shift_logits = full_logits[..., :-1, :].contiguous()
            flat_labels = shift_labels.view(-1)
            flat_logits = shift_logits.view(-1, shift_logits.size(-1))
            if labels_mask is not None:
                shift_mask = labels_mask[..., :-1].contiguous()
                flat_labels = flat_labels[shift_mask.view(-1)]
                flat_logits = flat_logits[shift_mask.view(-1)]
            loss = CrossEntropyLoss()(flat_logits, flat_labels)
        return {'loss': loss, 'logits': full_logits}


def build(attn_impl, alignment):
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=50, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0,
                     bos_token_id=1, eos_token_id=1)
    cfg._attn_implementation = attn_impl
    base = GPT2LMHeadModel(cfg).eval()
    cell = MemoryCell(base, num_mem_tokens=3)
    return RecurrentWrapper(cell, segment_size=6, segment_alignment=alignment).eval()


def reference_row(rmt, ids, mask):
    """One row, same segmentation, padded tokens *removed* from each segment (never attended),
    the real tokens and the write memory keeping the absolute positions they had in the batch."""
    cell = rmt.memory_cell
    m = cell.num_mem_tokens
    emb = cell.model.get_input_embeddings()
    memory = cell.memory[None]
    logits = torch.zeros(ids.shape[0], cell.model.config.vocab_size)
    for seg_ids, seg_mask in zip(rmt.split_tensor(ids[None]), rmt.split_tensor(mask[None])):
        seg_ids, seg_mask = seg_ids[0], seg_mask[0].bool()
        L = seg_ids.shape[0]
        real = torch.nonzero(seg_mask).flatten()
        embeds = torch.cat([memory, emb(seg_ids[real])[None], memory], dim=1)
        pos = torch.cat([torch.arange(m), m + real, m + L + torch.arange(m)])[None]
        out = cell.model(inputs_embeds=embeds, position_ids=pos, output_hidden_states=True)
        memory = out.hidden_states[-1][:, -m:]
        seg_logits = torch.zeros(L, logits.shape[1])
        seg_logits[real] = out.logits[0, m:m + real.numel()]
        yield seg_logits


def main():
    lengths = [15, 11, 8, 4]
    B, S = len(lengths), max(lengths)
    g = torch.Generator().manual_seed(3)
    input_ids = torch.zeros(B, S, dtype=torch.long)          # pad id 0, right padding
    attention_mask = torch.zeros(B, S, dtype=torch.long)
    for b, n in enumerate(lengths):
        input_ids[b, :n] = torch.randint(1, 50, (n,), generator=g)
        attention_mask[b, :n] = 1
    labels = input_ids.clone()
    # a token's label counts when the token it predicts is real: labels_mask[t] used at shift t
    labels_mask = torch.zeros(B, S, dtype=torch.bool)
    labels_mask[:, :-1] = attention_mask[:, 1:].bool()

    ok = True
    with torch.no_grad():
        for impl in ("eager", "sdpa"):
            rmt = build(impl, 'left')
            out = rmt(input_ids, labels=labels, labels_mask=labels_mask, attention_mask=attention_mask)
            nll, count = 0.0, 0
            for b, n in enumerate(lengths):
                alone = rmt(input_ids[b:b + 1, :n])           # no padding, no mask at all
                ref = alone['logits'][0]
                ok &= torch.allclose(out['logits'][b, :n], ref, atol=1e-5)
                if n > 1:
                    nll += torch.nn.functional.cross_entropy(ref[:-1], input_ids[b, 1:n], reduction='sum')
                    count += n - 1
            ref_loss = nll / count
            ok &= torch.allclose(out['loss'], ref_loss, atol=1e-5)
            print(f"{impl} right-padded, left-aligned: loss={out['loss'].item():.6f} ref={ref_loss.item():.6f}")

        # left padding, segment_alignment='right': a short row's first segment holds
        # [read mem | pads | real tokens | write mem] -- padding in the middle of the model input
        lp_ids = torch.zeros(B, S, dtype=torch.long)
        lp_mask = torch.zeros(B, S, dtype=torch.long)
        for b, n in enumerate(lengths):
            lp_ids[b, S - n:] = input_ids[b, :n]
            lp_mask[b, S - n:] = 1
        for impl in ("eager", "sdpa"):
            rmt = build(impl, 'right')
            out = rmt(lp_ids, attention_mask=lp_mask)
            for b in range(B):
                ref = torch.cat(list(reference_row(rmt, lp_ids[b], lp_mask[b])), dim=0)
                real = lp_mask[b].bool()
                ok &= torch.allclose(out['logits'][b][real], ref[real], atol=1e-5)
            # the mask is needed: without it the real tokens read the left padding
            unmasked = rmt(lp_ids)
            differs = not torch.allclose(unmasked['logits'][1][lp_mask[1].bool()],
                                         out['logits'][1][lp_mask[1].bool()], atol=1e-3)
            ok &= differs
            print(f"{impl} left-padded, right-aligned: matches key-dropped reference; unmasked run differs={differs}")
    print("matches the per-row references:", bool(ok))
    assert ok


if __name__ == "__main__":
    main()
