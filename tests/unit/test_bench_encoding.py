"""``python -m bench.encoding`` runs and says what it measured: the smallest run."""

from bench import encoding


def test_the_encoding_bench_reports_both_figures(capsys):
    encoding.main(["--rows", "20", "--repeats", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["log lines", "batch rows"]
    assert "20 rows a batch" in lines[1]
