"""MLPerf Inference Llama-2-70B reference SUT: batched prompts right-padded to max_seq_len before generate().

Citation: mlcommons/inference#1572 (fixes mlcommons/inference#1558), commit 5e2883bb
"Use left padding instead of right padding for BS>1 on Llama v2" (language/llama2-70b/SUT.py,
``SUT.process_queries``).

The bug: the offline SUT collates a batch of tokenized prompts by padding each one to
``max_seq_len = 1024`` with ``torch.nn.functional.pad(ids, (0, max_seq_len - input_len, 0, 0))``,
i.e. on the right (pad id = eos), with a matching 0-padded attention mask, and hands that to
``LlamaForCausalLM.generate``. Every row's generation then continues after its pad run: the first new
token is predicted from a pad slot and the generated tokens sit after the pads, so a short prompt's
answer differs from the one it gets alone (issue #1558: ROUGE dropped with BS>1).

The fix: pad on the left, ``(max_seq_len - input_len, 0, 0, 0)``, for both the ids and the mask.

Ported as the project wrote it (Dataset holds per-sample ``input_ids`` / ``attention_masks`` /
``input_lens``; ``process_queries`` collates, calls ``model.generate`` with greedy ``gen_kwargs``,
``Dataset.postProcess`` slices ``out_tokens[:, max_len:]``), with a tiny random Llama built from
``LlamaConfig`` instead of the 70B checkpoint, ``max_seq_len`` 1024 -> 12, ``max_new_tokens``
1024 -> 6, and loadgen's QuerySample / QuerySamplesComplete replaced by a small stand-in.
"""

import sys
from collections import namedtuple

import torch
from torch.nn.functional import pad
from transformers import LlamaConfig, LlamaForCausalLM

FIXED = "--fixed" in sys.argv

MAX_LEN = 12  # 1024 in the reference implementation

gen_kwargs = {
    "early_stopping": True,
    "max_new_tokens": 6,  # 1024 upstream
    "min_new_tokens": 1,
    "num_beams": 1,
    "do_sample": False,
}

QuerySample = namedtuple("QuerySample", ["id", "index"])  # mlperf_loadgen.QuerySample stand-in


class Tokenizer:
    """Stand-in for the Llama tokenizer: pad_token = eos_token, as SUT.load_model sets it."""

    bos_token_id = 1
    eos_token_id = 2
    pad_token_id = 2


class Dataset():
    def __init__(self, prompts, device="cpu"):
        self.max_length = MAX_LEN
        self.device = device
        self.input_ids = []
        self.input_lens = []
        self.attention_masks = []

        for ids in prompts:  # processed_data['tok_input']
            input_ids = torch.tensor(ids, dtype=torch.int32).view(1, -1).to(self.device)
            attn_mask = torch.ones_like(input_ids)
            self.input_ids.append(input_ids)
            self.attention_masks.append(attn_mask)
            self.input_lens.append(input_ids.shape[-1])
        self.total_sample_count = len(self.input_ids)

    def postProcess(self, out_tokens, input_seq_lens=None, query_id_list=None, sample_index_list=None):
        """ Postprocesses output prediction """
        # Everything is padded to max_len (1024), so prune the input and parse to numpy
        output_seq = out_tokens[:, MAX_LEN:].cpu().numpy()
        assert len(query_id_list) == output_seq.shape[0]
        return output_seq


class SUT():
    def __init__(self, data_object, batch_size=4):
        self.batch_size = batch_size
        self.data_object = data_object
        self.load_model()
        self.responses = {}

    def load_model(self):
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=64,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=2,
        )
        self.model = LlamaForCausalLM(config)
        self.model.eval()
        self.tokenizer = Tokenizer()

    def process_queries(self, qitem):
        query_ids = [q.index for q in qitem]

        # Construct / collate batch
        max_seq_len = MAX_LEN

        input_ids_tensor = []
        input_masks_tensor = []
        input_len = []
        for q in qitem:
            if FIXED:
                input_ids_tensor.append(pad(self.data_object.input_ids[q.index],
                                            (max_seq_len - self.data_object.input_lens[q.index], 0, 0, 0),
                                            value=self.tokenizer.pad_token_id))
                input_masks_tensor.append(pad(self.data_object.attention_masks[q.index],
                                              (max_seq_len - self.data_object.input_lens[q.index], 0, 0, 0),
                                              value=0))
            else:
                input_ids_tensor.append(pad(self.data_object.input_ids[q.index],
                                            (0, max_seq_len - self.data_object.input_lens[q.index], 0, 0),
                                            value=self.tokenizer.pad_token_id))
                input_masks_tensor.append(pad(self.data_object.attention_masks[q.index],
                                              (0, max_seq_len - self.data_object.input_lens[q.index], 0, 0),
                                              value=0))
            input_len.append(self.data_object.input_lens[q.index])
        input_ids_tensor = torch.cat(input_ids_tensor)
        input_masks_tensor = torch.cat(input_masks_tensor)

        assert input_ids_tensor.shape == input_masks_tensor.shape
        assert input_ids_tensor.shape[0] <= self.batch_size

        with torch.no_grad():
            pred_output_tokens = self.model.generate(
                input_ids=input_ids_tensor,
                attention_mask=input_masks_tensor,
                pad_token_id=self.tokenizer.pad_token_id,
                **gen_kwargs
            )

        processed_output = self.data_object.postProcess(pred_output_tokens,
                                                        input_seq_lens=input_len,
                                                        query_id_list=query_ids)
        for i in range(len(qitem)):  # lg.QuerySamplesComplete stand-in
            self.responses[qitem[i].id] = processed_output[i].tolist()


def main():
    prompts = [
        [1, 17, 33, 9, 41, 25, 12, 50, 7, 30, 22, 14],  # full length: no padding
        [1, 40, 11, 28, 5],
        [1, 19, 44, 36, 8, 61, 27, 10],
    ]
    data = Dataset(prompts)
    sut = SUT(data, batch_size=4)
    qitem = [QuerySample(id=100 + i, index=i) for i in range(data.total_sample_count)]
    sut.process_queries(qitem)
    for q in qitem:
        print(f"query {q.index}: generated {sut.responses[q.id]}")


if __name__ == "__main__":
    main()
