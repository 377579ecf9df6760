from hotpool.cli import main

main()
