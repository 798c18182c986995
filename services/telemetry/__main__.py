import sys

from talaria.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["telemetry", *sys.argv[1:]]))
