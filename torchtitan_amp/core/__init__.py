"""What every other package may import: errors, the torch-free rules and dtype tables, the
torch-version answers, the environment checks and the matmul-speed probe. Imports nothing of the
package above it."""
