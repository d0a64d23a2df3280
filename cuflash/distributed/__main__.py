"""``python -m cuflash.distributed``: the ring's cost model table (see :mod:`cuflash.distributed.cost`)."""
from .cost import table


def main():
    print("Local sequence length per rank above which the ring's K/V transfer is hidden. A MODEL, not a measurement:\n"
          "assumed bandwidths, latencies and throughputs; heads 32, head_dim 128; bf16 on GPUs, fp32 on CPUs.\n")
    print(table())


if __name__ == "__main__":
    main()
