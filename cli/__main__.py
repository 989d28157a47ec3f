from spes_cli.main import spes

spes(prog_name="spes")
