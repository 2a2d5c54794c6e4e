from runpool.cli import main

main()
