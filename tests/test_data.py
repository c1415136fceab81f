"""Datasets, prompts, the data order, and the embedded toy (tokenizer round trip, reproducible data,
model folder)."""
import json
import os

import pytest

from common import (DATASETS, TEMPLATES, load_dataset, load_tokenizer, prompt_token_ids,
                    take_prompts, template_messages)
from grpo import prompt

TOY_MODEL = DATASETS["toy"]["model"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write(path, lines):
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


def test_toy_dataset_has_train_and_test_splits():
    train, val, test = load_dataset("toy", eval_n=50)
    # no val.jsonl: test serves during training
    assert len(train) == 1920 and len(test) == 50 and val is None
    # each row as the file has it, and where it is: the file, its line, the split
    assert train[0]["row"].keys() == {"question", "answer"} and train[0]["row"]["answer"].isdigit()
    assert train[0]["where"] == f"{REPO}/toy/data/train.jsonl line 1 (train split)"
    assert test[7]["where"] == f"{REPO}/toy/data/test.jsonl line 8 (test split)"


def test_single_file_holds_out_a_fixed_eval_split(tmp_path):
    path = write(tmp_path / "d.jsonl", [json.dumps({"problem": f"p{i}", "answer": str(i)})
                                        for i in range(50)])
    train, val, test = load_dataset(path, eval_n=100)
    assert len(test) == 10 and len(train) == 40 and val is None  # at most a fifth is held out
    assert not {r["row"]["problem"] for r in test} & {r["row"]["problem"] for r in train}
    assert test == load_dataset(path, eval_n=100)[2]  # the same rows every time
    for r in train + test:  # each names its line in the file, and the split it went to
        line = int(r["row"]["problem"][1:]) + 1
        split = "test" if r in test else "train"
        assert r["where"] == f"{path} line {line} ({split} split)"


def test_a_folder_with_a_validation_split(tmp_path):
    """val.jsonl is evaluated during training, test.jsonl once at the end; each is cut to eval_n
    rows."""
    rows = [json.dumps({"question": f"q{i}", "answer": str(i)}) for i in range(30)]
    for name, part in (("train", rows[:10]), ("val", rows[10:20]), ("test", rows[20:])):
        write(tmp_path / f"{name}.jsonl", part)
    train, val, test = load_dataset(str(tmp_path), eval_n=4)
    assert [r["row"]["answer"] for r in train] == [str(i) for i in range(10)]
    assert [r["row"]["answer"] for r in val] == ["10", "11", "12", "13"]
    assert [r["row"]["answer"] for r in test] == ["20", "21", "22", "23"]
    assert val[1]["where"] == f"{tmp_path / 'val.jsonl'} line 2 (validation split)"
    train, val, test = load_dataset("chains", eval_n=1000)
    assert (len(train), len(val), len(test)) == (512, 150, 300)


def test_rows_reach_the_task_as_written(tmp_path):
    """Every column and value as the file has it: GSM8K's worked answer, an integer answer, a
    list, a solution without a \\boxed{} (code datasets have one) load unchanged; what the math
    reward reads of them is gold_answer's, in the default reward."""
    rows = [{"question": "q", "answer": "work\n#### 1,234"}, {"question": "q", "answer": 5},
            {"question": "q", "answer": ["a", "b"], "solution": "def f(): return 1"},
            {"problem": "p", "answer": " a,b #### c,d "}]
    path = write(tmp_path / "g.jsonl", [json.dumps(r) for r in rows])
    train, _, test = load_dataset(path, eval_n=1)
    assert sorted(map(json.dumps, [r["row"] for r in train + test])) == sorted(
        map(json.dumps, rows))


@pytest.mark.parametrize("lines,message", [
    (['{"question": "a", "answer": "1"}', "{not json"], "line 2 is not valid JSON"),
    (['{"question": "a", "answer": "1"}', '["a", "b"]'], "line 2 is not a JSON object"),
    ([""], "no rows"),
    # one row: none left to train on once one is held out
    (['{"question": "a", "answer": "1"}'], "bad.jsonl': 1 row, too few to hold one out for "
                                           "testing: give at least 2"),
])
def test_malformed_files_name_the_problem(tmp_path, lines, message):
    with pytest.raises(ValueError, match=message):
        load_dataset(write(tmp_path / "bad.jsonl", lines), eval_n=1)


def test_a_file_that_is_not_utf8_names_the_file_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"question": "a", "answer": "1"}\n{"question": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(ValueError) as e:
        load_dataset(str(path), eval_n=1)
    assert str(e.value).startswith(f"{path}: line 2 is not valid JSON in UTF-8"), str(e.value)


def test_unknown_dataset_names_the_choices():
    with pytest.raises(ValueError, match="no such file or folder \\(names: toy, chains"):
        load_dataset("no_such_dataset", eval_n=1)


def test_paper_prompts_are_verbatim():
    """docs/grpo.md#defaults: CPPO's system prompts as in its official recipes
    (github.com/lzhxmu/CPPO; a real newline; MATH's ends with a space and keeps {{ANSWER}}), verl's
    suffixes."""
    gsm = TEMPLATES["cppo_gsm8k"][0]
    assert gsm.startswith("A conversation between User and Assistant. The user asks a question")
    assert gsm.endswith("<think> reasoning process here </think>\n<answer> answer here </answer>.")
    math_prompt = TEMPLATES["cppo_math"][0]
    assert ("'Therefore, the final answer is: $\\boxed{{ANSWER}}$. I hope it is correct' "
            "(without quotes)" in math_prompt)
    assert math_prompt.endswith("answer here </answer>. ")
    assert TEMPLATES["verl_math"] == (None, "{question} Let's think step by step and output the "
                                             "final answer within \\boxed{}.")
    assert (DATASETS["gsm8k"]["template"] == "cppo_gsm8k"
            and DATASETS["math"]["template"] == "cppo_math")


def test_prompts_go_through_the_chat_template():
    """grpo.py's prompt(row, template): --template's messages around the row's question, which
    prompt_token_ids puts through the tokenizer's chat template."""
    tokenizer = load_tokenizer(TOY_MODEL)

    def text(question, template):
        rows = [{"row": {"question": question}, "where": "q.jsonl line 1"}]
        ids = prompt_token_ids(tokenizer, rows, prompt, template, 10**6)
        return tokenizer.decode(ids[0]["prompt_ids"])
    assert text("What is 1 + 2?", "plain") == \
        "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n"
    assert (text("Q", "cppo_gsm8k").startswith("<|im_start|>system\nA conversation")
            and text("Q", "cppo_gsm8k").endswith("user\nQ<|im_end|>\n<|im_start|>assistant\n"))
    assert text("Q", "verl_math").endswith("within \\boxed{}.<|im_end|>\n<|im_start|>assistant\n")
    assert template_messages("plain", "Q") == [{"role": "user", "content": "Q"}]


def test_a_prompt_of_ones_own_reads_any_column():
    """A prompt(row, template) of one's own: the rows keep every column of the dataset."""
    tokenizer = load_tokenizer(TOY_MODEL)
    rows = [{"row": {"question": "Q", "answer": "1", "hint": "count twice"}, "where": "line 1"}]

    def own(row, template):
        return [{"role": "system", "content": row["hint"]},
                {"role": "user", "content": row["question"]}]
    ids = prompt_token_ids(tokenizer, rows, own, "plain", 10**6)[0]["prompt_ids"]
    assert tokenizer.decode(ids).startswith("<|im_start|>system\ncount twice<|im_end|>")


def test_overlong_prompts_are_dropped():
    tokenizer = load_tokenizer(TOY_MODEL)
    rows = [{"row": {"question": "What is 1 + 2?", "answer": "3"}, "where": "line 1"},
            {"row": {"question": "x " * 500, "answer": "1"}, "where": "line 2"}]
    kept = prompt_token_ids(tokenizer, rows, prompt, "plain", max_prompt_len=64)
    assert ([r["row"]["answer"] for r in kept] == ["3"]
            and kept[0]["prompt_ids"][0] == tokenizer.convert_tokens_to_ids("<|im_start|>"))


def test_data_order_is_a_function_of_seed_and_cursor():
    n = 10
    first = take_prompts(n, 0, 25, seed=3)
    # each epoch a permutation
    assert sorted(first[:10]) == list(range(10)) and sorted(first[10:20]) == list(range(10))
    assert first[:10] != first[10:20]  # a new order every epoch
    # resuming at a cursor continues the stream
    assert take_prompts(n, 0, 7, 3) + take_prompts(n, 7, 18, 3) == first
    assert take_prompts(n, 0, 25, seed=4) != first


def test_toy_tokenizer_round_trips_spaces_and_newlines():
    """AutoTokenizer returns Qwen2Tokenizer for a qwen2 folder; the toy's byte-level BPE must
    survive that swap."""
    tokenizer = load_tokenizer(TOY_MODEL)
    text = "What is  47 + 38?\n\nA: <answer>85</answer>\t done"
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"


def test_toy_model_folder_is_servable_by_vllm_cpu():
    config = json.load(open(os.path.join(TOY_MODEL, "config.json")))
    tokenizer = load_tokenizer(TOY_MODEL)
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    # vllm-cpu's smallest head size
    assert config["hidden_size"] // config["num_attention_heads"] >= 32
    # padded like Qwen's, so the vocabulary mask is exercised
    assert config["vocab_size"] > len(tokenizer)
    assert tokenizer.chat_template


def test_toy_data_is_reproduced_by_the_build_script(tmp_path):
    from toy.build import make_problems, write_jsonl
    test, train, _ = make_problems()
    write_jsonl(tmp_path / "train.jsonl", train)
    write_jsonl(tmp_path / "test.jsonl", test)
    for name in ("train.jsonl", "test.jsonl"):
        assert open(tmp_path / name).read() == open(os.path.join(REPO, "toy", "data", name)).read()
