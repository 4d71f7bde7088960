"""Data advice: each finding appears when, and only when, the data calls for it."""

from llmcustoms.planning.data_advice import advice, data_facts, length_percentiles

CLEAN = {"rows": 1000, "duplicates": 0, "near_empty_replies": 0}


def test_clean_data_with_enough_rows_and_steps_gets_no_advice():
    assert advice(CLEAN, [100] * 900, 512, 0, 0, total_steps=200, epochs=2) == []


def test_each_problem_is_named_with_what_to_do():
    report = {"rows": 1000, "duplicates": 80, "near_empty_replies": 3}
    lengths = [100] * 40 + [900] * 10
    lines = advice(report, lengths, 512, truncated=10, dropped=2, total_steps=5, epochs=1)
    assert lines[0].startswith("80 exact duplicates (8%") and "consider removing them" in lines[0]
    assert lines[1].startswith("3 replies are under 5 characters")
    assert lines[2] == "10 rows are longer than 512 tokens and lose the end of their reply: --max-seq-len 900 would keep 99% whole"
    assert lines[3].startswith("2 rows have no reply left within 512 tokens")
    assert lines[4].startswith("only 50 training rows")
    assert lines[5].startswith("only 5 optimizer steps (1 epochs)")


def test_steps_the_user_chose_are_not_advised_on():
    assert advice(CLEAN, [100] * 900, 512, 0, 0, total_steps=4, epochs=None) == []


def test_facts_hold_percentiles_and_the_counts():
    facts = data_facts(CLEAN, list(range(1, 101)), "tokenizer", 512, 0, 0, 100, 1)
    assert facts["train_token_lengths"] == length_percentiles(range(1, 101)) == {"p50": 50, "p90": 90, "p99": 99, "max": 100}
    assert facts["rows"] == 1000 and facts["advice"] == []


def test_suspicious_rows_come_first_with_count_lines_and_what_to_do():
    found = [{"kind": "placeholder", "rows": 10, "first_lines": ["line 2", "line 3", "line 4"], "what": ["{{...}}"],
              "finding": "template placeholders never filled in", "advice": "fill them in or remove those rows"},
             {"kind": "echo_reply", "rows": 1, "first_lines": ["row 7 at line 9"], "what": [],
              "finding": "replies identical to their prompt", "advice": "fix or remove that row"}]
    lines = advice({**CLEAN, "duplicates": 5, "suspicious": found}, [100] * 900, 512, 0, 0, total_steps=200, epochs=2)
    assert lines[:2] == ["template placeholders never filled in ({{...}}): 10 rows (line 2, line 3, line 4, ...); "
                         "fill them in or remove those rows",
                         "replies identical to their prompt: 1 row (row 7 at line 9); fix or remove that row"]
    assert lines[2].startswith("5 exact duplicates")
