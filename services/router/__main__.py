from talaria.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["router", *__import__("sys").argv[1:]]))
