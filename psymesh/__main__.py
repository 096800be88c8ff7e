from psymesh.cli import main

main()
