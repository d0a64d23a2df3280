"""``python -m cuflash.distributed``: the ring's cost model table (see :mod:`cuflash.distributed.cost`)."""
import argparse

from .._cli import exit_with
from .cost import table


def main(argv=None) -> int:
    argparse.ArgumentParser(prog="python -m cuflash.distributed",
                            description="the ring attention cost model's table (assumed bandwidths, latencies and "
                                        "throughputs; no options)").parse_args(argv)
    print("Local sequence length per rank above which the ring's K/V transfer is hidden. A MODEL, not a measurement:\n"
          "assumed bandwidths, latencies and throughputs; heads 32, head_dim 128; bf16 on GPUs, fp32 on CPUs.\n")
    print(table())
    return 0


if __name__ == "__main__":
    exit_with(main)
